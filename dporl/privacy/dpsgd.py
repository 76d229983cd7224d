"""Per-unit DP-SGD: clip each privacy unit's gradient, sum, add Gaussian noise, divide by the expected batch.

A unit (expert, trajectory or transition) may own several rows in a batch; its gradient is the gradient of the
MEAN of its rows' losses, so it never mixes two units, and its clipped contribution is bounded by C whatever the
number of rows. Noise N(0, sigma^2 C^2) per coordinate; division by the public expected batch size q * n_units
(never by the realised batch size, which is private under Poisson sampling).

Clipping modes (all give the same update up to float error; ``benchmarks/bench_dpsgd.py`` times them):

- ``bookkeeping`` (default): forward hooks keep each trainable ``nn.Linear``'s input a; one backward pass yields
  the gradients g of the layer outputs (weight gradients are never formed by autograd). Per-unit norms come from
  a and g (ghost norms: ||g_r||^2 ||a_r||^2 for single-row units, Gram products within a unit otherwise), and
  the clipped sum is one matmul per layer: (c * G)^T A (Bu et al., "book-keeping" DP), accumulated in place into
  the parameter's noise.
- ``ghost``: the same norms, then a second backward pass of the clip-weighted loss (classic ghost clipping).
- ``opacus``: Opacus ``GradSampleModule`` per-row gradients, summed per unit (materialises rows x |params|).
- ``naive``: one autograd pass per unit; the reference the others are tested against.

The kernels the modes share (the Linear tape, the unit layout of a batch, ghost norms) are in
``dporl.privacy.dpsgd_kernels``; this module holds the engine and its statistics.

Cost. A private step should cost what a non-private one does plus the per-unit norms: the engine does not check
unit ids that a library sampler produced (``samplers.RowLayout`` states what it guarantees; ids from user code are
checked), draws the noise of all parameters in one call where they live (on a CUDA device for CUDA parameters) and
accumulates the clipped sum into it in place, computes single-row units' norms for all layers together (two row
reductions per layer, then one expression), and turns statistics into numbers only when someone reads them
(``StepStats``), so an ordinary step never waits for the device. On the CPU the next step's noise can be drawn on
a background thread while this step runs (``prefetch_noise``; by default where a core is left over by torch's
threads): the same numbers, off the critical path, but the same CPU work.

Hooks. The engine registers forward hooks on the module (its Linear tape, or Opacus' hooks). ``close()`` (or
``with DPSGDEngine(...) as engine:``) removes them all and stops the noise thread (joined); an engine dropped
without ``close`` removes its tape's hooks when it is collected (the thread, a daemon, stops with its noise source),
and a forgotten engine that is still referenced keeps at most one step's activations.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Literal, Optional, Sequence

import torch
from torch import nn

from dporl.privacy.dpsgd_kernels import LinearTape, UnitLayout, check_row_weights, ghost_sq_norms, unit_values
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import RowLayout
from dporl.utils.validation import ValidationError, check_positive

ClippingMode = Literal["bookkeeping", "ghost", "opacus", "naive"]
MODES: tuple[str, ...] = ("bookkeeping", "ghost", "opacus", "naive")


class StepStats:
    """Curator diagnostics of one private step (clip fraction and norms of the sampled units' gradients).

    Holds the units' norms as a tensor and converts them to numbers only when a property is read, so a step whose
    statistics nobody logs never synchronises with the device. These numbers depend on private data without noise:
    they belong to the curator, never in a release or a shared log.
    """

    __slots__ = ("n_units", "noise_std", "_norms", "_sq_norms", "_max_grad_norm", "_values")

    def __init__(
        self,
        n_units: int,
        norms: Optional[torch.Tensor],
        max_grad_norm: float,
        noise_std: float,
        *,
        sq_norms: Optional[torch.Tensor] = None,
    ):
        self.n_units = int(n_units)  # units sampled this step (units owning no rows have norm 0)
        self.noise_std = float(noise_std)  # per-coordinate std of the noise added to the sum
        # Norms (or squared norms) of the units that own rows; the others' are 0.
        self._norms = None if norms is None else norms.detach()
        self._sq_norms = None if sq_norms is None else sq_norms.detach()
        self._max_grad_norm = max_grad_norm
        self._values: Optional[tuple[float, float, float]] = None

    def _compute(self) -> tuple[float, float, float]:
        if self._values is None:
            n, norms = self.n_units, self._norms
            if norms is None and self._sq_norms is not None:
                norms = self._sq_norms.sqrt()
            if n == 0:
                self._values = (0.0, math.nan, math.nan)
            elif norms is None or norms.numel() == 0:
                self._values = (0.0, 0.0, 0.0)
            else:
                packed = torch.stack(
                    [(norms > self._max_grad_norm).sum().to(norms.dtype), norms.sum(), norms.max()]
                ).double().cpu()
                clipped, total, largest = packed.tolist()
                self._values = (clipped / n, total / n, max(largest, 0.0))
        return self._values

    @property
    def clip_fraction(self) -> float:  # fraction of units whose gradient norm exceeded C
        return self._compute()[0]

    @property
    def mean_norm(self) -> float:  # mean pre-clip unit gradient norm (nan for an empty batch)
        return self._compute()[1]

    @property
    def max_norm(self) -> float:
        return self._compute()[2]

    def to_dict(self) -> dict[str, float]:
        return {
            "units": float(self.n_units),
            "clip_fraction": self.clip_fraction,
            "grad_norm": self.mean_norm,
            "max_grad_norm": self.max_norm,
        }

    def __repr__(self) -> str:
        return f"StepStats(n_units={self.n_units}, noise_std={self.noise_std:g})"


def _spare_core() -> bool:
    """Whether this process may run on more cores than torch's intra-op threads use (a core for the noise)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this platform
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


def write_flat_gradients(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Write a flat vector into the parameters' ``.grad`` (in the given order)."""
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValidationError("direction", f"length {flat.numel()} != trainable parameters {total}")
    for p, chunk in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.grad = chunk.reshape(p.shape).to(p.dtype).clone()


class DPSGDEngine:
    """Writes privatised gradients into ``module``'s trainable parameters; the optimizer step stays the caller's.

    Use it as a context manager (or call ``close()``) so that its hooks leave the module with it.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        noise: NoiseSource,
        mode: ClippingMode = "bookkeeping",
        prefetch_noise: Optional[bool] = None,
    ):
        self.max_grad_norm = check_positive("dp.max_grad_norm", max_grad_norm)
        # sigma = 0 is for tests only: events refuse it, so an accounted run can never pair with it.
        self.noise_multiplier = check_positive("dp.noise_multiplier", noise_multiplier, allow_zero=True)
        self.expected_batch_size = check_positive("expected_batch_size", expected_batch_size)
        if mode not in MODES:
            raise ValidationError("dp.clipping", f"unknown mode {mode!r}")
        self.module = module
        self.noise = noise
        self.mode = mode
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValidationError("module", "has no trainable parameters")
        self._tape = LinearTape(module) if mode in ("bookkeeping", "ghost") else None
        # Per tape layer: (position of its weight in self.params, of its bias or None when it has no trainable one).
        position = {id(p): i for i, p in enumerate(self.params)}
        self._slots = [] if self._tape is None else [
            (position[id(layer.weight)], None if layer.bias is None else position.get(id(layer.bias)))
            for layer in self._tape.layers
        ]
        biased = [bias is not None for _, bias in self._slots]
        self._biased = None if all(biased) else biased  # per tape layer, whether its bias is trained (None: all)
        # Draw the next step's noise on a background thread while this step runs (CPU parameters only; the stream,
        # hence a fixed seed's numbers, is unchanged: NoiseSource.prefetch_like). None: where a core is left over.
        if prefetch_noise is None:
            prefetch_noise = all(p.device.type == "cpu" for p in self.params) and _spare_core()
        self.prefetch_noise = bool(prefetch_noise)
        self._grad_sample_module = None
        if mode == "opacus":
            from opacus import GradSampleModule

            # Hooks are attached in place; the algorithm keeps calling its own submodules.
            self._grad_sample_module = GradSampleModule(module, batch_first=True, loss_reduction="sum", force_functorch=False)
        self.last_stats: Optional[StepStats] = None
        self.closed = False

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Remove every hook this engine put on the module and what they recorded, and stop drawing noise ahead
        (joining its thread; the noise stream is rewound to the next draw); idempotent."""
        if self.prefetch_noise:
            self.noise.close()
        if self._tape is not None:
            self._tape.close()
        if self._grad_sample_module is not None:
            self._grad_sample_module._close()  # removes Opacus' hooks and its attributes on the parameters
            for submodule in self.module.modules():
                if hasattr(submodule, "activations"):
                    del submodule.activations
            self._grad_sample_module = None
        self.closed = True

    def __enter__(self) -> "DPSGDEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValidationError("engine", "this DPSGDEngine was closed; create a new one")

    # ------------------------------------------------------------------ public API
    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.max_grad_norm

    def private_backward(
        self,
        row_losses: torch.Tensor,
        unit_index: torch.Tensor,
        n_units: int,
        *,
        layout: Optional[RowLayout] = None,
        row_weights: Optional[torch.Tensor] = None,
    ) -> StepStats:
        """Per-unit clipped, noised, averaged gradient of ``row_losses`` into ``.grad`` of the trainable parameters.

        ``layout``: what a library sampler guarantees about ``unit_index`` (``Batch.layout``); with it the ids are
        not checked again. Without it they are checked (one device synchronisation).

        ``row_weights`` (optional, [n_rows], |w| <= 1, equal within a unit) multiply each unit's gradient AFTER it
        is clipped: the sum is sum_u w_u clip_C(grad of unit u's mean row loss). A unit's contribution is then still
        at most C in norm, and two weightings differ by at most |w_u - w'_u| C per unit: with row loss Q(s, a) and
        weight the clipped TD error, this is the semi-gradient of a Huber loss with per-transition Jacobians clipped
        (reward-level Q-learning, ``dporl.algos.fnq``).
        """
        self._check_open()
        if row_losses.dim() != 1 or unit_index.shape != row_losses.shape:
            raise ValidationError("row_losses", f"expected [n_rows] matching unit_index, got {tuple(row_losses.shape)}")
        if n_units < 0:
            raise ValidationError("unit_index", f"n_units must be >= 0, got {n_units}")
        if layout is not None and not isinstance(layout, RowLayout):
            raise ValidationError("layout", f"expected a samplers.RowLayout, got {type(layout).__name__}")
        blocks = None if layout is None else layout.rows_per_unit  # equal contiguous blocks: no ids needed at all
        if blocks is not None and (len(row_losses) % blocks or len(row_losses) > blocks * n_units):
            raise ValidationError("layout", f"{len(row_losses)} rows are not blocks of {blocks} rows")
        if blocks is None:
            unit_index = unit_index.to(row_losses.device).long()
        if layout is None and len(unit_index):  # ids from user code: checked (one synchronisation)
            bounds = torch.stack([unit_index.min(), unit_index.max()]).tolist()
            if bounds[0] < 0 or bounds[1] >= n_units:
                raise ValidationError("unit_index", f"unit ids must lie in [0, {n_units})")
        if row_weights is not None:
            row_weights = check_row_weights(row_weights, unit_index, n_units, row_losses, blocks)
        if n_units == 0 or row_losses.numel() == 0:
            if self._tape is not None:
                self._tape.discard()
            self._clear_grad_samples()
            self._write([None] * len(self.params))
            self.last_stats = StepStats(n_units, None, self.max_grad_norm, self.noise_std)
            return self.last_stats
        if self.mode in ("bookkeeping", "ghost"):
            if blocks == 1 and row_weights is None and self.mode == "bookkeeping":
                stats = self._single_rows(row_losses, n_units)
                if stats is not None:
                    self.last_stats = stats
                    return stats
            if blocks is not None:
                units = UnitLayout(n_units, blocks, True)
                weights = 1.0 / blocks  # the unit's loss is the mean over its rows
            else:
                counts = torch.bincount(unit_index, minlength=n_units)
                units = UnitLayout.build(unit_index, counts)
                weights = 1.0 / counts[unit_index].to(row_losses.dtype)
            norms, sq_norms = self._ghost(row_losses, units, weights, self.mode == "ghost", row_weights)
            self.last_stats = StepStats(n_units, norms, self.max_grad_norm, self.noise_std, sq_norms=sq_norms)
            return self.last_stats
        else:
            unit_index = unit_index.to(row_losses.device).long()  # (per-sample modes always index by unit)
            counts = torch.bincount(unit_index, minlength=n_units)
            weights = 1.0 / counts[unit_index].to(row_losses.dtype)
            if self.mode == "naive":
                sums, norms = self._naive(row_losses, unit_index, n_units, weights, row_weights)
            else:
                sums, norms = self._opacus(row_losses, unit_index, n_units, weights, row_weights)
            sums = [s.div_(self.expected_batch_size) for s in sums]
            self._write(sums)
        self.last_stats = StepStats(n_units, norms, self.max_grad_norm, self.noise_std)
        return self.last_stats

    def private_direction(self, unit_vectors: torch.Tensor) -> torch.Tensor:
        """Clip each row of ``unit_vectors`` [n_units, D], sum, add noise, divide by the expected batch."""
        self._check_open()
        if unit_vectors.dim() != 2:
            raise ValidationError("unit_vectors", f"expected [n_units, D], got {tuple(unit_vectors.shape)}")
        norms = unit_vectors.norm(dim=1)
        factors = self._clip_factors(norms)
        total = (unit_vectors * factors.unsqueeze(1)).sum(0)
        total = total + self.noise.gaussian_like([total], self.noise_std)[0]
        self.last_stats = StepStats(len(unit_vectors), norms, self.max_grad_norm, self.noise_std)
        return total / self.expected_batch_size

    def write_gradients(self, flat: torch.Tensor) -> None:
        write_flat_gradients(self.params, flat)

    def public_backward(self, row_losses: torch.Tensor) -> None:
        """An ordinary mean-loss backward, for noiseless steps on public or released-stable data."""
        self._check_open()
        if self._tape is not None:
            self._tape.discard()
        row_losses.mean().backward()
        self._clear_grad_samples()

    # ------------------------------------------------------------------ internals
    def _clip_factors(self, norms: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """scale * min(1, C / norm), written as scale * C / max(norm, C) (1 for a zero gradient)."""
        return torch.clamp(norms, min=self.max_grad_norm).reciprocal_().mul_(scale * self.max_grad_norm)

    def _noise(self) -> list[torch.Tensor]:
        """Fresh N(0, (sigma C / B)^2) tensors like the parameters (drawn where they live), in ``self.params``
        order, so the stream does not depend on which layers ran; the next step's is started ahead if asked."""
        std = self.noise_std / self.expected_batch_size
        return self.noise.gaussian_like(self.params, std, draw_ahead=self.prefetch_noise)

    def _write(self, sums: Sequence[Optional[torch.Tensor]]) -> None:
        """p.grad = noise / B + sum for every parameter, the noise drawn into the gradient's own buffer.

        ``sums`` are already divided by B (None: nothing but noise).
        """
        noise = self._noise()
        for p, buffer, total in zip(self.params, noise, sums):
            if total is not None:
                buffer.add_(total)
            p.grad = buffer

    def _ghost(self, row_losses, units: UnitLayout, weights, second_pass: bool, row_weights=None):
        """Clipped sum into ``.grad``; returns (norms, squared norms) of the groups' gradients (one is None)."""
        live = [(slot, a, out) for slot, (_, a, out) in zip(self._slots, self._tape.take()) if out is not None]
        if isinstance(weights, float):
            weighted = row_losses.sum() if weights == 1.0 else row_losses.sum() * weights
        else:
            weighted = (row_losses * weights).sum()
        grads = torch.autograd.grad(weighted, [out for _, _, out in live], retain_graph=second_pass)
        scale = self.max_grad_norm / self.expected_batch_size  # C / B, folded into the products below
        with torch.no_grad():
            norms = sq = None
            if units.block and units.kmax <= 1 and all(g.dim() == 2 for g in grads):
                biased = [bias is not None for (_, bias), _, _ in live]
                norms = self._row_norms([a for _, a, _ in live], grads, None if all(biased) else biased)
                # Each row's factor C / max(norm, C), times 1/B (the division by the expected batch): scale below.
                row_factor = torch.clamp(norms, min=self.max_grad_norm).reciprocal_()
            else:
                for ((_, bias), a, _), g in zip(live, grads):
                    sq = ghost_sq_norms(a, g, units, bias is not None, out=sq)
                row_factor = units.row_values(torch.clamp(sq, min=self.max_grad_norm**2).rsqrt_())
            if row_weights is not None:  # applied after clipping: each unit's clipped gradient times its weight
                row_factor = row_factor * row_weights
            if second_pass:
                with torch.enable_grad():
                    total = (row_losses * weights * (row_factor * scale)).sum()
                    sums = torch.autograd.grad(total, self.params, allow_unused=True)
                self._write(list(sums))
            else:
                self._write_bookkeeping(live, grads, row_factor, scale)
        return norms, sq

    def _single_rows(self, row_losses: torch.Tensor, n_units: int) -> Optional[StepStats]:
        """Book-keeping clipping when every unit owns one row and every layer ran once on 2-D rows (what a
        Poisson step over units or transitions of an MLP is): ``_ghost``'s computation with nothing left to decide
        per step, so that the step costs its products and norms and little else. None: not that case (nothing
        taken; the general path runs)."""
        taken = self._tape.take_rows()
        if taken is None:
            return None
        grads = torch.autograd.grad(row_losses.sum(), [out for _, _, out in taken])
        clip = self.max_grad_norm
        with torch.no_grad():
            norms = self._row_norms([a for _, a, _ in taken], grads, self._biased)
            factor = torch.clamp(norms, min=clip).reciprocal_()  # C / max(norm, C), the C folded into the scale
            live = [(slot, a, out) for slot, (_, a, out) in zip(self._slots, taken)]
            self._write_bookkeeping(live, grads, factor, clip / self.expected_batch_size)
        return StepStats(n_units, norms, clip, self.noise_std)

    @staticmethod
    def _row_norms(inputs, grads, biased: Optional[list[bool]]) -> torch.Tensor:
        """Norms [rows] of single-row units' gradients: sqrt(sum over layers ||g_r||^2 (||a_r||^2 + 1)), the 1
        for a layer with a trainable bias (the weight of a constant input 1); two row reductions per layer, then a
        handful of operations for all layers together. ``biased``: per layer, whether its bias is trained (None:
        every layer's is)."""
        g_norms = torch.stack([torch.linalg.vector_norm(g, dim=1) for g in grads])  # [layers, rows]
        a_norms = torch.stack([torch.linalg.vector_norm(a, dim=1) for a in inputs])
        bias_part = g_norms if biased is None else g_norms * g_norms.new_tensor(biased).unsqueeze(1)
        # Per layer and row ||g|| sqrt(||a||^2 + [bias]) = hypot(||g|| ||a||, [bias] ||g||); then the norm over layers
        # (on the CPU as a sum of squares: torch's CPU norm over the first of two dimensions is 7-20x slower at
        # 256-1024 rows; on a GPU one reduction kernel rather than three).
        per_layer = torch.hypot(a_norms.mul_(g_norms), bias_part)
        if per_layer.is_cuda:
            return torch.linalg.vector_norm(per_layer, dim=0)
        return per_layer.square_().sum(0).sqrt_()

    def _write_bookkeeping(self, live, grads, row_factor: torch.Tensor, scale: float) -> None:
        """p.grad = noise / B + scale (c * G)^T A per layer: the clipped sum accumulated into the noise in place."""
        noise = self._noise()
        column = row_factor.unsqueeze(1)
        for ((weight, bias), a, _), g in zip(live, grads):
            factor, factor_column = row_factor, column
            if g.dim() != 2:  # rows with a time axis: every step of a row shares the row's factor
                steps = g.numel() // (g.shape[-1] * row_factor.shape[0])
                g, a = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])
                factor = row_factor.repeat_interleave(steps)
                factor_column = factor.unsqueeze(1)
            if bias is not None:
                noise[bias].addmv_(g.T, factor, alpha=scale)
            if g.shape[1] <= a.shape[1]:  # scale the narrower side: (c * G)^T A = G^T (c * A)
                # autograd's fresh output gradient is ours to scale in place (no rows x width temporary)
                scaled = g.mul_(factor_column) if g.is_contiguous() else g * factor_column
                noise[weight].addmm_(scaled.T, a, alpha=scale)
            else:
                noise[weight].addmm_(g.T, a * factor_column, alpha=scale)
        for p, buffer in zip(self.params, noise):
            p.grad = buffer

    def _opacus(self, row_losses, unit_index, n_units, weights, row_weights=None):
        self._clear_grad_samples()
        with warnings.catch_warnings():
            # Opacus' full backward hooks warn when the inputs (observations) need no gradient; expected here.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            (row_losses * weights).sum().backward()
        per_unit = []
        for p in self.params:
            grad_sample = getattr(p, "grad_sample", None)
            if grad_sample is None:
                grad_sample = torch.zeros(len(row_losses), *p.shape, device=p.device, dtype=p.dtype)
            per_unit.append(torch.zeros(n_units, *p.shape, device=p.device, dtype=p.dtype).index_add_(0, unit_index, grad_sample))
        self._clear_grad_samples()
        norms = torch.sqrt(sum(u.reshape(n_units, -1).pow(2).sum(1).double() for u in per_unit))
        factors = self._clip_factors(norms).to(row_losses.dtype)
        if row_weights is not None:
            factors = factors * unit_values(row_weights, unit_index, n_units)
        sums = [(u * factors.view(-1, *([1] * (u.dim() - 1)))).sum(0) for u in per_unit]
        for p in self.params:
            p.grad = None
        return sums, norms

    def _naive(self, row_losses, unit_index, n_units, weights, row_weights=None):
        sums = [torch.zeros_like(p) for p in self.params]
        norms = torch.zeros(n_units, dtype=torch.float64)
        unit_weights = None if row_weights is None else unit_values(row_weights, unit_index, n_units)
        for unit in range(n_units):
            mask = unit_index == unit
            if not mask.any():
                continue
            grads = torch.autograd.grad((row_losses[mask] * weights[mask]).sum(), self.params, retain_graph=True, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
            norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
            norms[unit] = norm
            factor = float(self._clip_factors(norm))
            if unit_weights is not None:
                factor *= float(unit_weights[unit])
            for s, g in zip(sums, grads):
                s.add_(g, alpha=factor)
        return sums, norms

    def _clear_grad_samples(self) -> None:
        for p in self.params:
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
