"""Cost of one DP-SGD step relative to a non-private step, every clipping mode, measured in one run.

Setup (the issue's target): discrete CQL on a ReLU Q-network (2 x 256 by default), CartPole-sized inputs
(4 -> 2 actions), B privacy units per step, Adam built by the trainer's ``build_optimizer`` (fused where torch has
it) for every mode, so the ratio compares like with like. Every mode gets its own fresh copy of one initial
network, its own optimizer and its own engine (closed afterwards: no hooks survive into the next mode).

Times are CPU seconds of this process by default on the CPU (one torch thread; every thread of the process counts,
so noise drawn ahead on a background thread costs what it costs), ``--clock wall`` the critical path (what drawing
ahead can shorten when a second core is free); wall seconds with device synchronisation on CUDA. Rounds interleave
the modes (in a rotating order), each mode timing a block of steps per round, so that machine load affects every
mode alike; a ratio is computed per round against the non-private step of the same round and the same rows, and
the median and min-max over rounds are printed. ``--quick`` only has fewer rounds: it is built the same way, so a
ratio below 1 there is noise of the estimate, not an artefact of the order.

``--grid``: at each grid point (2x256 and 3x512 nets, batch 256 and 1024; on CUDA also 3x1024 at 4096 and 2x256
at 256), the DP step / non-private step ratio of dporl's book-keeping engine (also with the noise drawn ahead on
CPU), Opacus' per-sample hooks (``GradSampleModule`` + ``DPOptimizer``) and Opacus' ghost clipping
(``GradSampleModuleFastGradientClipping`` + ``DPOptimizerFastGradientClipping``), all interleaved in the same
rounds against the same non-private step, on the same CQL row loss and fused Adam. Opacus' hooks materialise
batch x parameters per-sample gradients: skipped (and said so) above ``--opacus-hooks-max-gb``.

Rows: "secret noise" draws the noise from a ``SecretRoot`` stream (full 19968-bit MT19937 state, as the trainer
does), "seeded noise" from ``torch.Generator().manual_seed(0)``: same sampler, so the difference measures the cost
of the secret streams. "+ sampling" rows include drawing the batch (Poisson over units from a secret generator,
vs uniform rows for the non-private step).

    python benchmarks/bench_dpsgd.py                 # batch 256, 2 x 256, every mode
    python benchmarks/bench_dpsgd.py --sweep         # book-keeping vs non-private, batch 64-1024, 2x256 and 3x512
    python benchmarks/bench_dpsgd.py --quick         # smoke test (seconds)
    python benchmarks/bench_dpsgd.py --grid          # dporl vs Opacus hooks / ghost clipping over the grid
    python benchmarks/bench_dpsgd.py --device cuda   # on a GPU (times synchronise the device)
    python benchmarks/bench_dpsgd.py --sweep --before-engine OLD/dporl/privacy/dpsgd.py
                                                     # also an older engine with plain Adam (before/after)
    python benchmarks/bench_dpsgd.py --grid --before-engine OLD/dporl/privacy/dpsgd.py
                                                     # and an older engine (and the noise.py and dpsgd_kernels.py
                                                     # beside it) with this optimizer
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import warnings

import torch

from dporl.algos.cql import CQLConfig, DiscreteCQLModule
from dporl.privacy.dpsgd import DPSGDEngine
from dporl.privacy.noise import NoiseSource
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.samplers import Batch, PoissonUnitSource, RowLayout, UniformBatchSource
from dporl.train.config import OptimizerConfig
from dporl.train.trainer import build_optimizer

OBS_DIM, N_ACTIONS = 4, 2


def make_batch(units: int, rows_per_unit: int, generator: torch.Generator, device: torch.device) -> Batch:
    rows = units * rows_per_unit
    data = {
        "obs": torch.randn(rows, OBS_DIM, generator=generator),
        "actions": torch.randint(0, N_ACTIONS, (rows,), generator=generator),
        "rewards": torch.randn(rows, generator=generator),
        "next_obs": torch.randn(rows, OBS_DIM, generator=generator),
        "terminated": torch.zeros(rows, dtype=torch.bool),
    }
    # The layout a PoissonUnitSource attaches: contiguous blocks of rows_per_unit rows per sampled unit.
    return Batch(data, torch.arange(units).repeat_interleave(rows_per_unit), units, private=True,
                 layout=RowLayout(rows_per_unit)).to(device)


def make_columns(n_units: int, rows_per_unit: int, generator: torch.Generator, device: torch.device):
    batch = make_batch(n_units, rows_per_unit, generator, device)
    return batch.data, batch.unit_index.cpu()


@dataclass
class Mode:
    name: str
    rows_per_unit: int
    baseline: str  # the non-private mode with the same rows
    step: Callable[[], None]
    close: Callable[[], None] = lambda: None
    slow: bool = False


class Setup:
    """One fresh network, optimizer (and engine) per mode, all from the same initial weights."""

    def __init__(self, args, hidden: list[int], batch: int, device: torch.device):
        self.args, self.batch, self.device = args, batch, device
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.initial = DiscreteCQLModule(OBS_DIM, N_ACTIONS, CQLConfig(hidden_sizes=hidden))
        self.batches = {k: make_batch(batch, k, generator, device) for k in (1, 4)}
        # Sources over a population of 10 * batch units, rate 0.1: B units per step in expectation.
        population = 10 * batch
        data, units = make_columns(population, 4, generator, device)
        self.private_source = PoissonUnitSource(data, units, population, batch / population, rows_per_unit=1)
        self.public_source = UniformBatchSource(data, batch)
        self.optimizer_config = OptimizerConfig(name="adam", lr=1e-4)

    def fresh(self):
        model = copy.deepcopy(self.initial).to(self.device)
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], self.optimizer_config)
        return model, optimizer

    def non_private(self, k: int, sampling: bool = False) -> Mode:
        model, optimizer = self.fresh()
        fixed = self.batches[k]
        generator = torch.Generator().manual_seed(1)

        def step():
            batch = self.public_source.sample(generator) if sampling else fixed
            optimizer.zero_grad(set_to_none=True)
            model.row_losses(batch).mean().backward()
            optimizer.step()

        name = f"non-private ({self.batch * k} rows)" + (" + sampling" if sampling else "")
        return Mode(name, k, name, step)

    def before(self, engine_file: str, k: int, fused: bool = False) -> list[Mode]:
        """Another ``dpsgd.py`` (e.g. a previous release's) beside this one, in the same rounds, with the noise source
        of the ``noise.py`` beside it when there is one. ``fused=False``: with plain Adam, as an older trainer built
        it, and its own non-private step; ``fused=True``: its book-keeping DP step alone, with this trainer's
        optimizer, against this run's non-private step."""
        kernels_file = Path(engine_file).with_name("dpsgd_kernels.py")
        if kernels_file.exists():  # the older engine with its own kernels (bound when it is loaded)
            current = sys.modules["dporl.privacy.dpsgd_kernels"]
            sys.modules["dporl.privacy.dpsgd_kernels"] = _load(str(kernels_file), "before_dpsgd_kernels")
            try:
                module = _load(engine_file, "before_dpsgd")
            finally:
                sys.modules["dporl.privacy.dpsgd_kernels"] = current
        else:
            module = _load(engine_file, "before_dpsgd")
        noise_file = Path(engine_file).with_name("noise.py")
        noise_module = _load(str(noise_file), "before_noise") if noise_file.exists() else None
        modes = []
        for private in (False, True):
            if fused and not private:
                continue
            model = copy.deepcopy(self.initial).to(self.device)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = (build_optimizer(params, self.optimizer_config) if fused else torch.optim.Adam(params, lr=1e-4))
            batch = self.batches[k]
            baseline = f"non-private ({self.batch * k} rows)" if fused else f"before: non-private ({self.batch * k} rows)"
            if not private:
                def step(model=model, optimizer=optimizer, batch=batch):
                    optimizer.zero_grad(set_to_none=True)
                    model.row_losses(batch).mean().backward()
                    optimizer.step()

                modes.append(Mode(baseline, k, baseline, step))
                continue
            generator = SecretRoot().torch_generator("before/noise")
            source = (noise_module.NoiseSource(generator=generator) if noise_module is not None
                      else NoiseSource(generator=generator))
            engine = module.DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.0,
                                        expected_batch_size=self.batch, noise=source)
            takes_layout = "layout" in inspect.signature(engine.private_backward).parameters

            def step(model=model, optimizer=optimizer, batch=batch, engine=engine):
                optimizer.zero_grad(set_to_none=True)
                extra = {"layout": batch.layout} if takes_layout else {}
                engine.private_backward(model.row_losses(batch), batch.unit_index, batch.n_units, **extra)
                optimizer.step()

            def close(engine=engine):
                if hasattr(engine, "close"):
                    engine.close()
                else:  # an engine without close(): remove its tape's hooks by hand
                    for handle in engine._tape.handles:
                        handle.remove()

            modes.append(Mode(f"before: bookkeeping (rows/unit={k})", k, baseline, step, close))
        return modes

    def private(self, mode: str, k: int, noise: str = "secret", sampling: bool = False, prefetch: bool = False,
                device_noise: bool = True) -> Mode:
        model, optimizer = self.fresh()
        if noise == "secret":
            source = SecretRoot().noise("bench/noise")
        else:
            source = NoiseSource(generator=torch.Generator().manual_seed(0), reproducible=True)
        source.device_draws = device_noise  # False: drawn on the CPU and copied (the same numbers on every device)
        engine = DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=self.batch,
                             noise=source, mode=mode, prefetch_noise=prefetch)
        fixed = self.batches[k]
        generator = SecretRoot().torch_generator("bench/sampler")

        def step():
            batch = self.private_source.sample(generator) if sampling else fixed
            optimizer.zero_grad(set_to_none=True)
            engine.private_backward(model.row_losses(batch), batch.unit_index, batch.n_units, layout=batch.layout)
            optimizer.step()

        label = f"{mode} (rows/unit={k}, {noise} noise)" + (" + sampling" if sampling else "") + (
            " + noise drawn ahead" if prefetch else "") + ("" if device_noise or self.device.type == "cpu" else
                                                          ", CPU noise copied")
        baseline = f"non-private ({self.batch * k} rows)" + (" + sampling" if sampling else "")
        return Mode(label, k, baseline, step, engine.close, slow=mode in ("opacus", "naive"))


    def opacus(self, ghost: bool) -> Mode:
        """Opacus' own private step on the same row loss: per-sample hooks + DPOptimizer, or ghost clipping (two
        backward passes) + DPOptimizerFastGradientClipping; noise from torch's default generator on the device."""
        from opacus import GradSampleModule
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        model, optimizer = self.fresh()
        batch = self.batches[1]
        common = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=self.batch, loss_reduction="mean")
        if ghost:
            wrapped = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                                           max_grad_norm=1.0, use_ghost_clipping=True)
            dp_optimizer = DPOptimizerFastGradientClipping(optimizer, **common)

            def step():
                dp_optimizer.zero_grad(set_to_none=True)
                DPTensorFastGradientClipping(wrapped, dp_optimizer, model.row_losses(batch), "mean").backward()
                dp_optimizer.step()
        else:
            wrapped = GradSampleModule(model, batch_first=True, loss_reduction="mean")
            dp_optimizer = DPOptimizer(optimizer, **common)

            def step():
                dp_optimizer.zero_grad(set_to_none=True)
                model.row_losses(batch).mean().backward()
                dp_optimizer.step()

        name = "opacus ghost clipping" if ghost else "opacus per-sample hooks"
        return Mode(name, 1, f"non-private ({self.batch} rows)", step, wrapped._close, slow=not ghost)

    def per_sample_gigabytes(self) -> float:
        """Memory of the per-sample gradients Opacus' hooks hold (batch x trainable parameters, float32)."""
        return 4 * self.batch * sum(p.numel() for p in self.initial.parameters() if p.requires_grad) / 2**30


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WALL = False  # --clock wall


def clock(device: torch.device):
    """CPU time of this process on the CPU (on a shared machine wall time also measures the neighbours'
    work: preemption, not the step); wall time on an accelerator, whose work is not this process's CPU time,
    or when asked (--clock wall: the critical path, which noise drawn ahead on another core shortens)."""
    return time.perf_counter if device.type == "cuda" or WALL else time.process_time


def clock_name(device: torch.device) -> str:
    return "wall time" if device.type == "cuda" or WALL else "CPU time"


def time_block(mode: Mode, steps: int, device: torch.device) -> float:
    now = clock(device)
    synchronise(device)
    start = now()
    for _ in range(steps):
        mode.step()
    synchronise(device)
    return (now() - start) / steps


def measure(modes: list[Mode], rounds: int, block_seconds: float, device: torch.device) -> dict[str, list[float]]:
    """Per-step seconds of every mode in every round; modes interleaved in a rotating order."""
    steps = {}
    for mode in modes:  # warm up, and size each mode's block to about block_seconds
        time_block(mode, 3, device)
        per_step = time_block(mode, 2, device)
        steps[mode.name] = max(1, min(200, round(block_seconds / max(per_step, 1e-6))))
    times: dict[str, list[float]] = {mode.name: [] for mode in modes}
    for r in range(rounds):
        shift = r % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            times[mode.name].append(time_block(mode, steps[mode.name], device))
    return times


def report(modes: list[Mode], times: dict[str, list[float]]) -> list[tuple[str, float, float, float, float]]:
    """(name, median ms, median ratio, min ratio, max ratio); ratios per round against the same round's baseline."""
    rows = []
    for mode in modes:
        ratios = [t / b for t, b in zip(times[mode.name], times[mode.baseline])]
        rows.append((mode.name, 1e3 * statistics.median(times[mode.name]), statistics.median(ratios),
                     min(ratios), max(ratios)))
    return rows


def print_rows(rows, header: str, device: torch.device) -> None:
    print(header)
    print(f"{'mode':66s} {'ms/step':>8s} {'ratio (median)':>15s} {'min-max over rounds':>20s}  ({clock_name(device)})")
    for name, ms, ratio, low, high in rows:
        print(f"{name:66s} {ms:8.3f} {ratio:14.3f}x {low:9.3f}-{high:.3f}x")


def run_main(args, device: torch.device) -> None:
    setup = Setup(args, args.hidden, args.batch, device)
    modes = [setup.non_private(1), setup.non_private(4), setup.non_private(1, sampling=True)]
    modes += [
        setup.private("bookkeeping", 1, "secret"),
        setup.private("bookkeeping", 1, "seeded"),
        *([setup.private("bookkeeping", 1, "secret", prefetch=True)] if device.type == "cpu" else
          [setup.private("bookkeeping", 1, "secret", device_noise=False)]),
        setup.private("bookkeeping", 4, "secret"),
        setup.private("bookkeeping", 1, "secret", sampling=True),
        setup.private("ghost", 1),
    ]
    if args.before_engine:
        modes += setup.before(args.before_engine, 1) + setup.before(args.before_engine, 4)
    if not args.fast_modes_only:
        modes += [setup.private("opacus", 1), setup.private("naive", 1)]
    fast = [m for m in modes if not m.slow]
    slow = [m for m in modes if m.slow]
    times = measure(fast, args.rounds, args.block_seconds, device)
    if slow:  # per-sample modes are 30-100x slower: fewer rounds, each still beside its own baselines
        baselines = [m for m in fast if m.name in {s.baseline for s in slow}]
        slow_times = measure(baselines + slow, max(3, args.rounds // 5), args.block_seconds, device)
        rows = report(fast, times) + report(slow, slow_times)  # against the baselines of their own rounds
    else:
        rows = report(fast, times)
    for mode in modes:
        mode.close()
    net = "x".join(str(h) for h in args.hidden)
    print_rows(rows, f"torch {torch.__version__}, device={device}, threads={torch.get_num_threads()}, "
                     f"batch={args.batch} units, {len(args.hidden)}x{args.hidden[0]} MLP ({net}), CQL loss, "
                     f"{args.rounds} interleaved rounds", device)


def run_sweep(args, device: torch.device) -> None:
    print(f"torch {torch.__version__}, device={device}, threads={torch.get_num_threads()}; book-keeping DP step "
          f"(rows/unit=1, secret noise) / non-private step, {args.rounds} interleaved rounds each")
    before = "  before: ratio (min-max), DP time after/before" if args.before_engine else ""
    print(f"{'net':>8s} {'batch':>6s} {'non-private ms':>15s} {'DP ms':>8s} {'ratio (median)':>15s} {'min-max':>14s}"
          + before)
    for hidden in ([256, 256], [512, 512, 512]):
        for batch in (64, 256, 1024):
            setup = Setup(args, hidden, batch, device)
            modes = [setup.non_private(1), setup.private("bookkeeping", 1, "secret")]
            if args.before_engine:
                modes += setup.before(args.before_engine, 1)
            times = measure(modes, args.rounds, args.block_seconds, device)
            rows = report(modes, times)
            (_, base_ms, *_), (_, ms, ratio, low, high) = rows[:2]
            line = f"{len(hidden)}x{hidden[0]:<4d} {batch:6d} {base_ms:15.3f} {ms:8.3f} {ratio:14.3f}x {low:6.3f}-{high:.3f}x"
            if args.before_engine:
                _, _, before_ratio, before_low, before_high = rows[3]
                speed = statistics.median(a / b for a, b in zip(times[modes[1].name], times[modes[3].name]))
                line += f"  {before_ratio:14.3f}x ({before_low:.3f}-{before_high:.3f}) {speed:8.3f}x"
            for mode in modes:
                mode.close()
            print(line, flush=True)


def grid_points(device: torch.device) -> list[tuple[list[int], int]]:
    points = [([256, 256], 256), ([256, 256], 1024), ([512, 512, 512], 256), ([512, 512, 512], 1024)]
    if device.type == "cuda":
        points.append(([1024, 1024, 1024], 4096))
    return points


def run_grid(args, device: torch.device) -> None:
    """Per grid point, every private step against the same non-private step, interleaved in the same rounds."""
    print(f"torch {torch.__version__}, device={device}, threads={torch.get_num_threads()}; DP step / non-private "
          f"step (CQL row loss, fused Adam, 1 row per unit), {args.rounds} interleaved rounds per grid point "
          f"(Opacus hooks: {max(3, args.rounds // 5)}), {clock_name(device)}, median (min-max over rounds)")
    variant = "dporl, noise drawn ahead" if device.type == "cpu" else "dporl, CPU noise copied"
    columns = ["dporl book-keeping", variant, "Opacus ghost clipping", "Opacus hooks"]
    print(f"{'net':>9s} {'batch':>6s} {'non-private ms':>15s} " + " ".join(f"{c:>26s}" for c in columns)
          + "  dporl / Opacus ghost (time)" + ("  before: book-keeping" if args.before_engine else ""))
    for hidden, batch in grid_points(device):
        net = f"{len(hidden)}x{hidden[0]}/{batch}"
        if args.points and net not in args.points:
            continue
        setup = Setup(args, hidden, batch, device)
        baseline = setup.non_private(1)
        dporl = setup.private("bookkeeping", 1, "secret")
        modes = [baseline, dporl]
        if device.type == "cpu":
            ahead = setup.private("bookkeeping", 1, "secret", prefetch=True)
        else:  # the noise drawn on the host's CPU and copied: what drawing on the device replaces
            ahead = setup.private("bookkeeping", 1, "secret", device_noise=False)
        modes.append(ahead)
        ghost = setup.opacus(ghost=True)
        modes.append(ghost)
        before = setup.before(args.before_engine, 1, fused=True)[0] if args.before_engine else None
        modes += [before] if before else []
        times = measure(modes, args.rounds, args.block_seconds, device)
        rows = {row[0]: row for row in report(modes, times)}
        hooks_cell = f"skipped ({setup.per_sample_gigabytes():.1f} GB)"
        if setup.per_sample_gigabytes() <= args.opacus_hooks_max_gb:
            hooks = setup.opacus(ghost=False)
            hook_times = measure([baseline, hooks], max(3, args.rounds // 5), args.block_seconds, device)
            _, _, ratio, low, high = report([hooks], hook_times)[0]
            hooks_cell = f"{ratio:.2f}x ({low:.2f}-{high:.2f})"
            hooks.close()

        def cell(mode):
            _, _, ratio, low, high = rows[mode.name]
            return f"{ratio:.3f}x ({low:.2f}-{high:.2f})"

        speed = statistics.median(a / b for a, b in zip(times[dporl.name], times[ghost.name]))
        print(f"{len(hidden)}x{hidden[0]:<5d} {batch:6d} {rows[baseline.name][1]:15.3f} "
              + " ".join(f"{c:>26s}" for c in [cell(dporl), cell(ahead), cell(ghost), hooks_cell])
              + f"  {speed:.3f}x" + (f"  {cell(before):>26s}" if before else ""), flush=True)
        for mode in modes:
            mode.close()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few rounds, fast modes only (a smoke test)")
    parser.add_argument("--sweep", action="store_true", help="book-keeping vs non-private over batch sizes and nets")
    parser.add_argument("--grid", action="store_true", help="dporl vs Opacus hooks and ghost clipping over the grid")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="on the CPU: this process's CPU time (default) or wall time (the critical path)")
    parser.add_argument("--points", type=lambda v: v.split(","), default=None,
                        help="--grid points to run, e.g. 2x256/256,3x1024/4096 (default: all)")
    parser.add_argument("--opacus-hooks-max-gb", type=float, default=1.0,
                        help="skip Opacus' per-sample hooks where their per-sample gradients exceed this")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[256, 256])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--block-seconds", type=float, default=None, help="time per mode per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fast-modes-only", action="store_true", help="skip the per-sample modes (opacus, naive)")
    parser.add_argument("--before-engine", default=None, help="another dpsgd.py to time beside this one (plain Adam)")
    args = parser.parse_args(argv)
    # Opacus' full backward hooks warn when the inputs (observations) need no gradient: expected here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.set_num_threads(args.threads)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 30
    if args.block_seconds is None:
        args.block_seconds = 0.02 if args.quick else 0.1
    args.fast_modes_only = args.fast_modes_only or args.quick
    device = torch.device(args.device)
    global WALL
    WALL = args.clock == "wall"
    if args.grid:
        run_grid(args, device)
    elif args.sweep:
        run_sweep(args, device)
    else:
        run_main(args, device)


if __name__ == "__main__":
    main()
