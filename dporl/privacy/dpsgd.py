"""Per-unit DP-SGD: clip each privacy unit's gradient, sum, add Gaussian noise, divide by the expected batch.

A unit (expert, trajectory or transition) may own several rows in a batch; its gradient is the gradient of the
MEAN of its rows' losses, so it never mixes two units, and its clipped contribution is bounded by C whatever the
number of rows. Noise N(0, sigma^2 C^2) per coordinate; division by the public expected batch size q * n_units
(never by the realised batch size, which is private under Poisson sampling).

Clipping modes (all give the same update up to float error; ``benchmarks/bench_dpsgd.py`` times them):

- ``bookkeeping`` (default): forward hooks keep each trainable ``nn.Linear``'s input a; one backward pass yields
  the gradients g of the layer outputs (weight gradients are never formed by autograd). Per-unit norms come from
  a and g (ghost norms: ||g_r||^2 ||a_r||^2 for single-row units, Gram products within a unit otherwise), and
  the clipped sum is one matmul per layer: (c * G)^T A (Bu et al., "book-keeping" DP).
- ``ghost``: the same norms, then a second backward pass of the clip-weighted loss (classic ghost clipping).
- ``opacus``: Opacus ``GradSampleModule`` per-row gradients, summed per unit (materialises rows x |params|).
- ``naive``: one autograd pass per unit; the reference the others are tested against.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
from torch import nn

from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError, check_positive

ClippingMode = Literal["bookkeeping", "ghost", "opacus", "naive"]


@dataclass(frozen=True)
class StepStats:
    n_units: int
    clip_fraction: float  # fraction of units whose gradient norm exceeded C
    mean_norm: float  # mean pre-clip unit gradient norm (nan for an empty batch)
    max_norm: float
    noise_std: float  # per-coordinate std of the noise added to the sum


class _LinearTape:
    """Records the input and output of every grad-enabled call of the trainable Linear layers of a module."""

    def __init__(self, module: nn.Module):
        self.layers = [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
        covered = {id(p) for layer in self.layers for p in layer.parameters()}
        stray = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in covered]
        if stray:
            raise ValidationError(
                "dp.clipping", f"bookkeeping/ghost clipping supports nn.Linear only; {stray} is not (use 'opacus')"
            )
        self.records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.handles = [layer.register_forward_hook(self._hook) for layer in self.layers]

    def _hook(self, layer: nn.Module, inputs, output) -> None:
        if torch.is_grad_enabled() and output.requires_grad:
            self.records.setdefault(id(layer), []).append((inputs[0].detach(), output))

    def take(self) -> list[tuple[nn.Linear, Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """(layer, input a, output) per layer since the last take; a layer never called yields (layer, None, None)."""
        taken = []
        for layer in self.layers:
            calls = self.records.get(id(layer), [])
            if len(calls) > 1:
                self.records.clear()
                raise ValidationError(
                    "dp.clipping",
                    f"layer {layer} ran {len(calls)} times with gradients in one step; per-unit norms need one "
                    "call per layer (compute targets under torch.no_grad, or use clipping='opacus')",
                )
            taken.append((layer, *calls[0]) if calls else (layer, None, None))
        self.records.clear()
        return taken

    def discard(self) -> None:
        self.records.clear()


@dataclass(frozen=True)
class _UnitLayout:
    """How rows map onto units: ``kmax`` rows at most per unit, and a cheap path when rows come in blocks.

    Samplers emit the rows of a unit contiguously and, with ``rows_per_unit`` set, in equal blocks; then a
    reshape groups them. Otherwise rows are scattered into a zero-padded [n_units, kmax, ...] tensor.
    """

    unit_index: torch.Tensor
    n_units: int
    kmax: int
    block_units: Optional[torch.Tensor]  # unit of each contiguous block of kmax rows, when that layout holds
    order: Optional[torch.Tensor] = None
    slot: Optional[torch.Tensor] = None

    @staticmethod
    def build(unit_index: torch.Tensor, counts: torch.Tensor) -> "_UnitLayout":
        n_units = len(counts)
        kmax = int(counts.max()) if n_units else 0
        if kmax <= 1:
            return _UnitLayout(unit_index, n_units, kmax, unit_index)
        present = counts[counts > 0]
        blocks = unit_index[::kmax]
        if bool((present == kmax).all()) and torch.equal(unit_index, blocks.repeat_interleave(kmax)):
            return _UnitLayout(unit_index, n_units, kmax, blocks)
        order = torch.argsort(unit_index, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(order), device=unit_index.device) - starts[unit_index[order]]
        return _UnitLayout(unit_index, n_units, kmax, None, order, slot)

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [R, (T,) d] -> [groups, kmax * T, d]; groups are blocks (see ``to_units``) or all units."""
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        steps, width = x.shape[1], x.shape[2]
        if self.block_units is not None:
            return x.reshape(-1, max(self.kmax, 1) * steps, width)
        out = x.new_zeros(self.n_units, self.kmax, steps, width)
        out[self.unit_index[self.order], self.slot] = x[self.order]
        return out.reshape(self.n_units, self.kmax * steps, width)

    def to_units(self, per_group: torch.Tensor) -> torch.Tensor:
        if self.block_units is None:
            return per_group
        return per_group.new_zeros(self.n_units).index_add_(0, self.block_units, per_group)


def _ghost_sq_norms(a: torch.Tensor, g: torch.Tensor, layout: _UnitLayout, has_bias: bool) -> torch.Tensor:
    """Squared norms [n_units] of each unit's gradient of one Linear layer, from inputs a and output grads g."""
    if layout.kmax <= 1 and a.dim() == 2:
        g_sq = (g * g).sum(1)
        sq = g_sq * (a * a).sum(1) + (g_sq if has_bias else 0.0)
        return layout.to_units(sq)
    pa, pg = layout.group(a), layout.group(g)
    k, d_in, d_out = pa.shape[1], pa.shape[2], pg.shape[2]
    if k * (d_in + d_out) < d_in * d_out:  # Gram products are cheaper than forming the unit gradients
        sq = ((pg @ pg.transpose(1, 2)) * (pa @ pa.transpose(1, 2))).sum((1, 2))
    else:
        sq = torch.einsum("uko,uki->uoi", pg, pa).pow(2).sum((1, 2))
    if has_bias:
        sq = sq + pg.sum(1).pow(2).sum(1)
    return layout.to_units(sq)


def write_flat_gradients(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Write a flat vector into the parameters' ``.grad`` (in the given order)."""
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValidationError("direction", f"length {flat.numel()} != trainable parameters {total}")
    for p, chunk in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.grad = chunk.reshape(p.shape).to(p.dtype).clone()


class DPSGDEngine:
    """Writes privatised gradients into ``module``'s trainable parameters; the optimizer step stays the caller's."""

    def __init__(
        self,
        module: nn.Module,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        noise: NoiseSource,
        mode: ClippingMode = "bookkeeping",
    ):
        self.max_grad_norm = check_positive("dp.max_grad_norm", max_grad_norm)
        # sigma = 0 is for tests only: events refuse it, so an accounted run can never pair with it.
        self.noise_multiplier = check_positive("dp.noise_multiplier", noise_multiplier, allow_zero=True)
        self.expected_batch_size = check_positive("expected_batch_size", expected_batch_size)
        if mode not in ("bookkeeping", "ghost", "opacus", "naive"):
            raise ValidationError("dp.clipping", f"unknown mode {mode!r}")
        self.module = module
        self.noise = noise
        self.mode = mode
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValidationError("module", "has no trainable parameters")
        self._tape = _LinearTape(module) if mode in ("bookkeeping", "ghost") else None
        self._grad_sample_module = None
        if mode == "opacus":
            from opacus import GradSampleModule

            # Hooks are attached in place; the algorithm keeps calling its own submodules.
            self._grad_sample_module = GradSampleModule(module, batch_first=True, loss_reduction="sum", force_functorch=False)
        self.last_stats: Optional[StepStats] = None

    # ------------------------------------------------------------------ public API
    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.max_grad_norm

    def private_backward(self, row_losses: torch.Tensor, unit_index: torch.Tensor, n_units: int) -> StepStats:
        """Per-unit clipped, noised, averaged gradient of ``row_losses`` into ``.grad`` of the trainable parameters."""
        unit_index = unit_index.to(row_losses.device).long()
        if row_losses.dim() != 1 or unit_index.shape != row_losses.shape:
            raise ValidationError("row_losses", f"expected [n_rows] matching unit_index, got {tuple(row_losses.shape)}")
        if n_units < 0 or (len(unit_index) and (unit_index.min() < 0 or unit_index.max() >= n_units)):
            raise ValidationError("unit_index", f"unit ids must lie in [0, {n_units})")
        if n_units == 0 or row_losses.numel() == 0:
            if self._tape is not None:
                self._tape.discard()
            self._clear_grad_samples()
            sums = [torch.zeros_like(p) for p in self.params]
            return self._finish(sums, torch.zeros(n_units))
        counts = torch.bincount(unit_index, minlength=n_units)
        weights = 1.0 / counts[unit_index].to(row_losses.dtype)  # the unit's loss is the mean over its rows
        if self.mode == "naive":
            sums, norms = self._naive(row_losses, unit_index, n_units, weights)
        elif self.mode == "opacus":
            sums, norms = self._opacus(row_losses, unit_index, n_units, weights)
        else:
            sums, norms = self._ghost(row_losses, unit_index, counts, weights, second_pass=self.mode == "ghost")
        return self._finish(sums, norms)

    def private_direction(self, unit_vectors: torch.Tensor) -> torch.Tensor:
        """Clip each row of ``unit_vectors`` [n_units, D], sum, add noise, divide by the expected batch."""
        if unit_vectors.dim() != 2:
            raise ValidationError("unit_vectors", f"expected [n_units, D], got {tuple(unit_vectors.shape)}")
        norms = unit_vectors.norm(dim=1)
        factors = self._clip_factors(norms)
        total = (unit_vectors * factors.unsqueeze(1)).sum(0)
        total = total + self.noise.gaussian(total.shape, self.noise_std, dtype=total.dtype).to(total.device)
        self.last_stats = self._stats(norms)
        return total / self.expected_batch_size

    def write_gradients(self, flat: torch.Tensor) -> None:
        write_flat_gradients(self.params, flat)

    def public_backward(self, row_losses: torch.Tensor) -> None:
        """An ordinary mean-loss backward, for noiseless steps on public or released-stable data."""
        if self._tape is not None:
            self._tape.discard()
        row_losses.mean().backward()
        self._clear_grad_samples()

    # ------------------------------------------------------------------ internals
    def _clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        return (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)

    def _stats(self, norms: torch.Tensor) -> StepStats:
        n = int(norms.numel())
        return StepStats(
            n_units=n,
            clip_fraction=float((norms > self.max_grad_norm).float().mean()) if n else 0.0,
            mean_norm=float(norms.mean()) if n else float("nan"),
            max_norm=float(norms.max()) if n else float("nan"),
            noise_std=self.noise_std,
        )

    def _finish(self, sums: Sequence[torch.Tensor], norms: torch.Tensor) -> StepStats:
        flat = torch.cat([s.reshape(-1) for s in sums])
        flat += self.noise.gaussian(flat.shape, self.noise_std, dtype=flat.dtype).to(flat.device)
        write_flat_gradients(self.params, flat.div_(self.expected_batch_size))
        self.last_stats = self._stats(norms.detach().cpu())
        return self.last_stats

    def _ghost(self, row_losses, unit_index, counts, weights, second_pass: bool):
        n_units = len(counts)
        records = self._tape.take()
        live = [(layer, a, out) for layer, a, out in records if out is not None]
        weighted = (row_losses * weights).sum()
        grads = torch.autograd.grad(weighted, [out for _, _, out in live], retain_graph=second_pass)
        layout = _UnitLayout.build(unit_index, counts)
        sq = torch.zeros(n_units, dtype=row_losses.dtype, device=row_losses.device)
        for (layer, a, _), g in zip(live, grads):
            sq += _ghost_sq_norms(a, g, layout, layer.bias is not None)
        norms = sq.sqrt()
        factors = self._clip_factors(norms).to(row_losses.dtype)
        row_factor = factors[unit_index]
        if second_pass:
            sums = torch.autograd.grad((row_losses * weights * row_factor).sum(), self.params, allow_unused=True)
            return [torch.zeros_like(p) if s is None else s for p, s in zip(self.params, sums)], norms
        by_param = {id(p): torch.zeros_like(p) for p in self.params}
        for (layer, a, _), g in zip(live, grads):
            scaled = g * row_factor.view(-1, *([1] * (g.dim() - 1)))
            by_param[id(layer.weight)] = scaled.reshape(-1, g.shape[-1]).T @ a.reshape(-1, a.shape[-1])
            if layer.bias is not None:
                by_param[id(layer.bias)] = scaled.reshape(-1, g.shape[-1]).sum(0)
        return [by_param[id(p)] for p in self.params], norms

    def _opacus(self, row_losses, unit_index, n_units, weights):
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
        sums = [(u * factors.view(-1, *([1] * (u.dim() - 1)))).sum(0) for u in per_unit]
        for p in self.params:
            p.grad = None
        return sums, norms

    def _naive(self, row_losses, unit_index, n_units, weights):
        sums = [torch.zeros_like(p) for p in self.params]
        norms = torch.zeros(n_units, dtype=torch.float64)
        for unit in range(n_units):
            mask = unit_index == unit
            if not mask.any():
                continue
            grads = torch.autograd.grad((row_losses[mask] * weights[mask]).sum(), self.params, retain_graph=True, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
            norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
            norms[unit] = norm
            factor = float(self._clip_factors(norm))
            for s, g in zip(sums, grads):
                s.add_(g, alpha=factor)
        return sums, norms

    def _clear_grad_samples(self) -> None:
        for p in self.params:
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
