"""Noise sources: the only place dporl draws privacy noise.

Threat note. If the seed of the noise generator is known (printed in a config, committed to a repository), anyone
can regenerate the noise and subtract it from a released model: the guarantee is void. ``NoiseSource(seed=None)``,
the default for real runs, therefore draws its seed from the operating system's CSPRNG and never reveals it. A fixed
seed is for tests and exact reproductions; the guarantee then holds only while the seed, and every checkpoint
(which stores the generator state and the device key), are kept secret like the data.
``dporl.privacy.secure_noise`` offers samplers that also resist floating-point attacks on the sampled values.

Where the noise is drawn.

- CPU tensors: torch's CPU generator (MT19937) with its whole 19968-bit state secret (``SecretRoot``). A DP-SGD
  step's draw (``gaussian_like``) is one ``torch.normal`` call of the parameters' total size rounded up to a
  multiple of 16, the padding dropped: torch's CPU kernel fills the uniforms in order, one generator output each,
  and turns them into normals in blocks of 16 (Box-Muller pairs i, i + 8), so a single call of k such sizes gives
  exactly the numbers of k consecutive calls. That is what lets the next steps' draws be made ahead on a
  background thread, several at once (``prefetch_like``): noise never depends on data, the draw order is kept (draws
  made ahead that are not the next ones asked for are undone by restoring the generator state from before them),
  and a fixed seed gives the same numbers with or without drawing ahead.
- CUDA tensors: on the device, by torch's counter-based Philox4x32-10 generator (Salmon et al. 2011, "Parallel
  random numbers: as easy as 1, 2, 3"), re-keyed for every draw from a 256-bit secret ``device key`` (the stream's
  own SeedSequence words, independent of the MT19937 state). Draw number t uses

      (seed_t, offset_t) = keyed BLAKE2b(device key, t)     64-bit Philox key, 61-bit secret counter offset

  Key space. torch's device generator takes a 64-bit seed (Philox's key) and an offset (the low 64 bits of
  Philox's 128-bit counter; thread i of a kernel uses counter (i << 64) + offset / 4 + j). Setting both per draw
  gives each draw 64 + 61 = 125 secret bits (the offset is a multiple of 4 below 2**63); consecutive counters of
  one draw span at most a few thousand values, so guessing an offset near the true one saves about 12 bits at most.
  To predict draw t one must know the device key (256 bits; BLAKE2b is a PRF) or guess that draw's ~113-125 bits;
  the draws' keys are independent PRF outputs, so learning one draw's noise exactly says nothing about another
  draw's. This is far stronger than the CPU stream's structure (MT19937 is linear: 624 consecutive outputs give its
  state) and much stronger than ``manual_seed`` alone (64 bits per draw, a search within reach of a large cluster).

  What it does NOT give: Philox is a statistically strong generator, not a cryptographic one (a cryptanalytic
  break recovering a Philox key from its outputs would expose the rest of that draw, never another draw); the
  values are textbook floating-point Box-Muller samples (``secure_noise`` for releases that must resist
  floating-point attacks); numbers are reproducible for a fixed seed only on the same GPU model and torch version
  (the kernel's launch grid, hence which counter feeds which element, depends on the device); and the re-keying is
  a host call, so it cannot run inside a captured CUDA graph.

  Alternative considered: a Philox or ChaCha20 kernel in Triton with a 128- or 256-bit key. Philox's key is 64 bits
  in every implementation (a Triton kernel could set all four counter words: 192 input bits, the same kind of
  guarantee as here), and ChaCha20 would be a real stream cipher but a new dependency and a Gaussian transform of
  our own, neither testable without a GPU. torch's generator with a per-draw secret (key, offset) gives >= 113
  secret bits per draw under a 256-bit PRF key, with torch's tested normal kernel.

  ``NoiseSource(device_draws=False)`` draws on the CPU and copies (the same numbers on every device); a source
  without a device key (built from a bare generator), and any subclass overriding ``gaussian`` (e.g. the exact
  discrete samplers), also draws on the CPU.
"""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from dporl.privacy.streams import DEVICE_KEY_BYTES, noise_stream, root_entropy, stream_sequence, torch_stream
from dporl.utils.validation import ValidationError, check_positive

_OFFSET_BITS = 61  # secret bits of the Philox offset: multiples of 4 below 2**63 (never near unsigned wrap-around)
_PERSON = b"dporl-dev-noise"  # BLAKE2b personalisation: these PRF outputs serve nothing else
_FILL = 16  # torch's CPU normal kernel turns uniforms into normals in blocks of this many
# Draws made ahead at once: as many steps as fit in this many bytes (at least one, at most _AHEAD_STEPS). Each block
# costs the thread one wake-up and two GIL hand-overs, so on small networks a block of many steps makes drawing
# ahead nearly free on the step's own thread; two blocks live at a time (the one in use and the next).
_AHEAD_BYTES = 8 << 20
_AHEAD_STEPS = 16
_KEPT_BUFFERS = 2  # buffers kept to draw into again (the one in use, and the one before, whose gradients are
# usually dropped by the time the next draw is asked for)


def secret_generator(seed: int | None = None) -> torch.Generator:
    """A generator for private sampling decisions (which units a Poisson step includes, which branch a mixture step
    takes). Amplification by subsampling assumes nobody knows these draws, so the seed comes from the OS CSPRNG
    unless one is given for an exact reproduction; a given seed must then be kept secret like a noise seed.
    The whole generator state is derived from the seed (stream "sampler" of the root ``SecretRoot(seed)``), never
    its low 32 bits.
    """
    entropy, _ = root_entropy(seed)
    return torch_stream(stream_sequence(entropy, "sampler"))


def device_draw_key(key: bytes, counter: int) -> tuple[int, int]:
    """(Philox seed, Philox offset) of device draw number ``counter`` under the 256-bit ``key``: a keyed BLAKE2b
    of the counter (a PRF), split into a 64-bit seed and a 61-bit offset times 4 (see the module docstring)."""
    if len(key) != DEVICE_KEY_BYTES:
        raise ValidationError("noise.device_key", f"expected {DEVICE_KEY_BYTES} bytes, got {len(key)}")
    if counter < 0 or counter >= 1 << 64:
        raise ValidationError("noise.device_draws", f"draw counter {counter} outside [0, 2**64)")
    digest = hashlib.blake2b(counter.to_bytes(8, "little"), key=key, digest_size=16, person=_PERSON).digest()
    seed = int.from_bytes(digest[:8], "little")
    offset = (int.from_bytes(digest[8:], "little") & ((1 << _OFFSET_BITS) - 1)) << 2
    return seed, offset


def _device_generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device)


def _device_normal(shape: tuple[int, ...], std: float, dtype: torch.dtype, device: torch.device,
                   generator: torch.Generator, seed: int, offset: int) -> torch.Tensor:
    """N(0, std^2) on ``device`` from Philox key ``seed`` at counter ``offset`` (one kernel)."""
    generator.manual_seed(seed)  # resets the offset to 0; set it after
    generator.set_offset(offset)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)


class _Worker:
    """One daemon thread that runs one job at a time (the next steps' noise draws), fed through two queues.

    The worker never refers to the source it serves (jobs are dropped once run), so a source that is collected
    stops its worker (``weakref.finalize``); ``stop`` joins the thread.
    """

    def __init__(self):
        self.pid = os.getpid()
        self.busy = False  # a job was submitted and its outcome not yet taken (the caller's thread only)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_work, args=(self._jobs, self._outcomes),
                                        name="dporl-noise-prefetch", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()  # a forked child has no such thread

    def submit(self, job: Callable[[], Any]) -> None:
        if self.busy:
            raise RuntimeError("the noise worker is busy")  # callers settle first; never two jobs at once
        self.busy = True
        self._jobs.put(job)

    def result(self) -> Any:
        value, error = self._outcomes.get()
        self.busy = False
        if error is not None:
            raise error
        return value

    def stop(self) -> None:
        if self.pid != os.getpid():
            return
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


def _work(jobs: queue.SimpleQueue, outcomes: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            outcome = (job(), None)
        except BaseException as error:  # handed to the caller, who raises it
            outcome = (None, error)
        del job
        outcomes.put(outcome)
        del outcome


class NoiseSource:
    """Gaussian and Laplace draws: Gaussian noise for CUDA tensors on the device, everything else on the CPU
    (see the module docstring for both generators, their keys and what a fixed seed reproduces)."""

    def __init__(
        self,
        seed: int | None = None,
        *,
        generator: torch.Generator | None = None,
        reproducible: bool | None = None,
        device_key: bytes | None = None,
        device_draws: bool = True,
    ):
        if generator is not None:
            if seed is not None:
                raise ValueError("give a seed or a generator, not both")
            self._generator = generator
            self.reproducible = bool(reproducible)
        else:
            entropy, _ = root_entropy(seed)  # stream "noise" of the root ``SecretRoot(seed)``
            self._generator, device_key = noise_stream(stream_sequence(entropy, "noise"))
            self.reproducible = seed is not None
        if device_key is not None and len(device_key) != DEVICE_KEY_BYTES:
            raise ValidationError("noise.device_key", f"expected {DEVICE_KEY_BYTES} bytes, got {len(device_key)}")
        self._device_key = None if device_key is None else bytes(device_key)
        self.device_draws = bool(device_draws)
        self._device_counter = 0  # device draws made so far: draw t is keyed by device_draw_key(key, t)
        self._device_generators: dict[torch.device, torch.Generator] = {}
        self._worker: Optional[_Worker] = None
        self._worker_finalizer = None
        self._ahead: Optional[_Ahead] = None  # draws made ahead on the worker (prefetch_like)
        self._buffers = _Buffers()  # the last CPU gaussian_like draws made here, to draw into again once unused

    # ------------------------------------------------------------------ Gaussian
    def gaussian(
        self, shape: Sequence[int] | int, std: float, dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """N(0, std^2) of ``shape``; on ``device`` (drawn there for CUDA, see the module docstring)."""
        std = check_positive("noise.std", std, allow_zero=True)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        device = None if device is None else torch.device(device)
        if device is not None and self._draws_on(device):
            return self._device_gaussian(shape, std, dtype, device)
        self._settle()
        # Drawn directly in the target precision, as Opacus does: float64 draws cost 5x more per DP-SGD step.
        values = torch.normal(0.0, std, shape, generator=self._generator, dtype=dtype)
        return values if device is None or device.type == "cpu" else values.to(device, non_blocking=True)

    def gaussian_like(self, tensors: Sequence[torch.Tensor], std: float, *, draw_ahead: bool = False
                      ) -> list[torch.Tensor]:
        """Fresh N(0, std^2) tensors shaped, typed and placed like ``tensors`` (e.g. one per parameter).

        One draw, split into views (no concatenation, no copy), in the tensors' order; on CUDA it is drawn on the
        device (one kernel), elsewhere on the CPU stream as the first values of one draw of the total size rounded
        up to a multiple of 16 (a draw made ahead by ``prefetch_like`` for the same request is used, see there). A
        subclass that overrides ``gaussian`` (e.g. exact discrete noise) is drawn through it on the CPU and copied.
        ``draw_ahead``: then ``prefetch_like(tensors, std)`` (what a DP-SGD step asks for every step).
        """
        ahead = self._ahead
        if ahead is not None and ahead.serves(tensors, std):  # the steady state of a DP-SGD step: nothing to check
            draws = self._take_ahead(ahead)
            if draw_ahead and not ahead.in_flight:
                self._submit(ahead)
            return draws
        draws = self._gaussian_like(tensors, std)
        if draw_ahead:
            self.prefetch_like(tensors, std)
        return draws

    def _gaussian_like(self, tensors: Sequence[torch.Tensor], std: float) -> list[torch.Tensor]:
        if not tensors:
            return []
        std = check_positive("noise.std", std, allow_zero=True)
        device, dtype = tensors[0].device, tensors[0].dtype
        if self._fast() and all(t.dtype == dtype for t in tensors):
            if self._draws_on(device):
                flat = self._device_gaussian((sum(t.numel() for t in tensors),), std, tensors[0].dtype, device)
                return _split_like(flat, tensors)
            if device.type == "cpu":
                ahead = self._ahead
                if ahead is not None and ahead.request == _request(tensors, std):
                    return self._take_ahead(ahead)
                self._settle()
                numel = sum(t.numel() for t in tensors)
                padded = _padded(numel)
                flat = _draw_block(self._generator, 1, padded, dtype, std, self._buffers.take(padded, dtype))
                self._buffers.keep(flat)
                return _split_like(flat[:numel], tensors)
        flat = self.gaussian(sum(t.numel() for t in tensors), std, dtype=tensors[0].dtype)
        if device.type != "cpu":
            flat = flat.to(device, non_blocking=True)
        return [chunk.view(t.shape).to(t.dtype) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def prefetch_like(self, tensors: Sequence[torch.Tensor], std: float) -> bool:
        """Keep the next ``gaussian_like(tensors, std)`` draws of CPU tensors being drawn on a background thread.

        Draws are made ahead in blocks of several steps (as many as fit in 8 MiB, up to 16), one ``torch.normal``
        call per block: the very numbers the next calls would draw one by one (the generator state before each
        block is kept). If the next draw asked for is another one (other shapes, another std, a Laplace draw,
        ``state_dict``), the draws made ahead and not yet used are dropped and the generator rewound to the first of
        them, so the stream a fixed seed gives never changes. Returns whether draws are being made ahead (never for
        CUDA tensors, drawn on the device, nor for a subclass's own ``gaussian``). Call ``close``
        (``DPSGDEngine.close`` does) to stop the thread.
        """
        ahead = self._ahead
        if ahead is None or not ahead.serves(tensors, std):
            if not tensors or not self._fast() or any(t.device.type != "cpu" or t.dtype != tensors[0].dtype for t in tensors):
                return False
            std = check_positive("noise.std", std, allow_zero=True)
            request = _request(tensors, std)
            if ahead is None or ahead.request != request:
                self._settle()
                ahead = self._ahead = _Ahead(request, sum(t.numel() for t in tensors), tensors[0].element_size())
            ahead.like = tensors
        if not ahead.in_flight:
            self._submit(ahead)
        return True

    def close(self) -> None:
        """Drop the draws made ahead, if any (rewinding the stream), and stop the background thread; the source
        stays usable."""
        self._settle()
        if self._worker_finalizer is not None:
            self._worker_finalizer()  # stops and joins the thread once
        self._worker, self._worker_finalizer = None, None

    # ------------------------------------------------------------------ Laplace
    def laplace(self, shape: Sequence[int] | int, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        scale = check_positive("noise.scale", scale)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self._settle()
        # Difference of two Exp(1) variables is Laplace(1); avoids log(0) at the ends of the uniform's support.
        first = torch.empty(shape, dtype=torch.float64).exponential_(generator=self._generator)
        second = torch.empty(shape, dtype=torch.float64).exponential_(generator=self._generator)
        return ((first - second) * scale).to(dtype)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        self._settle()
        state = {"generator": self._generator.get_state(), "reproducible": self.reproducible,
                 "device_draws": self._device_counter}
        if self._device_key is not None:
            state["device_key"] = torch.tensor(list(self._device_key), dtype=torch.uint8)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._settle()
        counter = state.get("device_draws", 0)
        if isinstance(counter, bool) or not isinstance(counter, int) or not 0 <= counter < 1 << 64:
            raise ValidationError("noise.device_draws", f"expected a draw count in [0, 2**64), got {counter!r}")
        key = state.get("device_key")
        if key is not None:
            if not isinstance(key, torch.Tensor) or key.dtype != torch.uint8 or key.shape != (DEVICE_KEY_BYTES,):
                raise ValidationError("noise.device_key", f"expected {DEVICE_KEY_BYTES} uint8 values")
            key = bytes(key.tolist())
        self._generator.set_state(state["generator"])
        self.reproducible = bool(state["reproducible"])
        self._device_counter = counter
        if key is not None:
            self._device_key = key

    # ------------------------------------------------------------------ internals
    def _fast(self) -> bool:
        """Whether this source's Gaussian is the base class's (device draws and drawing ahead apply)."""
        return type(self).gaussian is NoiseSource.gaussian

    def _draws_on(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.device_draws and self._device_key is not None and self._fast()

    def _device_gaussian(self, shape, std: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        generator = self._device_generators.get(device)
        if generator is None:
            generator = self._device_generators[device] = _device_generator(device)
        seed, offset = device_draw_key(self._device_key, self._device_counter)
        self._device_counter += 1
        return _device_normal(shape, std, dtype, device, generator, seed, offset)

    def _submit(self, ahead: "_Ahead") -> None:
        """Start drawing the next block of ``ahead`` on the worker (the generator is the worker's until it ends)."""
        if self._worker is None or not self._worker.alive():
            self._worker = _Worker()
            self._worker_finalizer = weakref.finalize(self, self._worker.stop)
        ahead.next_state = self._generator.get_state()
        _, dtype, std = ahead.request
        out = ahead.buffers.take(ahead.steps * ahead.padded, dtype)
        self._worker.submit(functools.partial(_draw_block, self._generator, ahead.steps, ahead.padded, dtype, std, out))
        ahead.in_flight = True

    def _take_ahead(self, ahead: "_Ahead") -> list[torch.Tensor]:
        """The next draw of ``ahead`` (views like the request's tensors), waiting for the next block when the one
        in use is spent."""
        if ahead.block is None or ahead.used == ahead.steps:
            if ahead.in_flight and not self._worker.alive():  # a forked child: the parent's thread drew the block
                self._settle()  # rewound to where that block began; then drawn again on a thread of this process
                self._ahead, ahead.block, ahead.in_flight, ahead.buffers = ahead, None, False, _Buffers()
            if not ahead.in_flight:  # prefetch_like was not called since the last block was taken
                self._submit(ahead)
            try:
                block = self._worker.result()
            except BaseException:
                self._ahead = None
                self._generator.set_state(ahead.next_state)  # the block failed: the stream stands before it
                raise
            ahead.buffers.keep(block)
            ahead.block, ahead.used, ahead.block_state = _step_views(block, ahead), 0, ahead.next_state
            ahead.in_flight, ahead.next_state = False, None
        ahead.used += 1
        return ahead.block[ahead.used - 1]

    def _settle(self) -> None:
        """Drop the draws made ahead, if any, and put the generator where the first unused one began."""
        ahead = self._ahead
        if ahead is None:
            return
        self._ahead = None
        if ahead.in_flight:
            if self._worker is not None and self._worker.alive():
                try:
                    self._worker.result()
                except Exception:  # the dropped block's own failure: nothing of it is used
                    pass
            else:  # a forked child: the thread that drew does not exist here
                self._worker, self._worker_finalizer = None, None
        if ahead.block is not None and ahead.used < ahead.steps:
            # Back to the start of the block in use, then the draws already handed out drawn again (one call).
            self._generator.set_state(ahead.block_state)
            if ahead.used:
                _, dtype, std = ahead.request
                _draw_block(self._generator, ahead.used, ahead.padded, dtype, std)
        elif ahead.in_flight:
            self._generator.set_state(ahead.next_state)


class _Ahead:
    """The draws made ahead for one ``gaussian_like`` request: a block of ``steps`` draws of ``padded`` values,
    kept as each step's views (``used`` of them handed out; the generator state before it, ``block_state``), and
    whether the next block is being drawn on the worker from ``next_state``."""

    __slots__ = ("request", "numel", "padded", "steps", "block", "used", "block_state", "next_state", "in_flight",
                 "like", "buffers")

    def __init__(self, request: tuple, numel: int, element_size: int):
        self.request, self.numel, self.padded = request, numel, _padded(numel)
        self.like: Sequence[torch.Tensor] = ()  # the sequence last checked against the request (identity)
        self.steps = max(1, min(_AHEAD_STEPS, _AHEAD_BYTES // (self.padded * element_size)))
        self.block: Optional[list[list[torch.Tensor]]] = None  # per step, the views of one draw
        self.used = 0
        self.block_state: Optional[torch.Tensor] = None
        self.next_state: Optional[torch.Tensor] = None
        self.in_flight = False
        self.buffers = _Buffers()  # the last blocks received, to draw into again once unused

    def serves(self, tensors: Sequence[torch.Tensor], std: float) -> bool:
        """Whether a request is this one without checking every tensor again: the very sequence that was checked
        (so all CPU, one dtype), with the same shapes, first dtype and std (a parameter moved or cast since then
        changes the first's dtype or device, or fails where its gradient is written)."""
        return tensors is self.like and tensors[0].is_cpu and self.request == _request(tensors, std)


class _Buffers:
    """The flat buffers of the last draws of one size and dtype, to draw into again once nothing refers to them
    (no view of one alive anywhere: no gradient, no step's views; whatever a caller keeps keeps its buffer from
    being reused). Fresh pages of a few MB cost more than the draw itself on some machines (a 3x512 network's
    DP step: 1.35x the non-private step with fresh noise buffers, 1.19x with reused ones)."""

    __slots__ = ("kept",)

    def __init__(self):
        self.kept: list[torch.Tensor] = []

    def keep(self, buffer: torch.Tensor) -> None:
        self.kept = [buffer] + self.kept[:_KEPT_BUFFERS - 1]

    def take(self, numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A kept buffer of ``numel`` values of ``dtype`` that nothing refers to, removed from the kept ones; None:
        allocate."""
        for i, buffer in enumerate(self.kept):
            if buffer.numel() == numel and buffer.dtype == dtype and _unshared(buffer):
                return self.kept.pop(i)
        return None


def _step_views(block: torch.Tensor, ahead: _Ahead) -> list[list[torch.Tensor]]:
    """A block of draws as, per step, views shaped like the request's tensors (two calls per tensor, made once a
    block rather than once a step)."""
    rows = block.view(ahead.steps, ahead.padded)
    per_tensor, offset = [], 0
    for shape in ahead.request[0]:
        numel = shape.numel()
        per_tensor.append(rows[:, offset:offset + numel].view(ahead.steps, *shape).unbind(0))
        offset += numel
    return [list(views) for views in zip(*per_tensor)]


def _padded(numel: int) -> int:
    """``numel`` rounded up to whole blocks of torch's CPU normal kernel (at least one)."""
    return max(1, -(-numel // _FILL)) * _FILL


def _draw_block(generator: torch.Generator, steps: int, padded: int, dtype: torch.dtype, std: float,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``steps`` consecutive draws of ``padded`` normals (a multiple of 16) in one call: the same numbers as
    ``steps`` calls of ``padded`` each, since the kernel draws its uniforms in order and never recomputes a tail.
    ``out``: a flat buffer of that size and dtype to draw into (the same numbers)."""
    if out is None:
        return torch.normal(0.0, std, (steps * padded,), generator=generator, dtype=dtype)
    return out.normal_(0.0, std, generator=generator)


def _unshared(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is held by that tensor alone (no view of it, anywhere, is alive): its use count
    equals a lone tensor's, measured the same way. Without torch's use count (a private function) nothing counts
    as unshared, so nothing is reused."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # Both storages are held by a name while they are counted (a temporary would be freed before the count).
    lone = torch.empty(1)
    storage, lone_storage = tensor.untyped_storage(), lone.untyped_storage()
    return use_count(storage._cdata) <= use_count(lone_storage._cdata)


def _request(tensors: Sequence[torch.Tensor], std: float) -> tuple:
    return tuple(t.shape for t in tensors), tensors[0].dtype, float(std)


def _split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors``, in order (one call into torch, as DDP's bucket views)."""
    return list(torch._utils._unflatten_dense_tensors(flat, tensors))
