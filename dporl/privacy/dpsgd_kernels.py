"""The clipping kernels of per-unit DP-SGD (``dporl.privacy.dpsgd``): what the engine's modes compute per step.

- ``LinearTape``: forward hooks keeping each trainable ``nn.Linear``'s input and output (bookkeeping and ghost
  clipping need no per-row weight gradients, Bu et al. 2023, "Differentially private optimization on large model
  at small cost").
- ``UnitLayout``: how the rows of a batch map onto its units (contiguous blocks, or scattered and zero-padded).
- ``ghost_sq_norms``: each unit's squared gradient norm of one Linear layer from its inputs and output gradients
  (Goodfellow 2015, "Efficient per-example gradient computations"; Gram products within a unit).
- ``unit_values`` / ``check_row_weights``: per-unit values from per-row ones, and the checks on row weights.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dporl.utils.validation import ValidationError


def _record(records: dict, layer: nn.Module, inputs, output) -> None:
    if output.requires_grad:  # False under no_grad / inference_mode: targets are never recorded
        previous = records.get(id(layer))
        records[id(layer)] = (1 if previous is None else previous[0] + 1, inputs[0], output)


class LinearTape:
    """Records the input and output of every grad-enabled call of the trainable Linear layers of a module.

    The hooks hold only the records, not the tape: a tape that is collected removes its hooks
    (``weakref.finalize``). A layer called more than once keeps only its latest call (and the count, which
    ``take`` refuses), so a tape that is never taken holds one step's activations at most.
    """

    def __init__(self, module: nn.Module):
        self.layers = [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
        covered = {id(p) for layer in self.layers for p in layer.parameters()}
        stray = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in covered]
        if stray:
            raise ValidationError(
                "dp.clipping", f"bookkeeping/ghost clipping supports nn.Linear only; {stray} is not (use 'opacus')"
            )
        # id(layer) -> (calls, input, output); inputs are used under no_grad only, so they need no detach.
        self.records: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        hook = functools.partial(_record, self.records)
        self._keys = [id(layer) for layer in self.layers]
        self.handles = [layer.register_forward_hook(hook) for layer in self.layers]
        self._finalizer = weakref.finalize(self, _remove_handles, list(self.handles))

    def take(self) -> list[tuple[nn.Linear, Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """(layer, input a, output) per layer since the last take; a layer never called yields (layer, None, None)."""
        records = dict(self.records)
        self.records.clear()
        taken = []
        for layer in self.layers:
            record = records.get(id(layer))
            if record is None:
                taken.append((layer, None, None))
                continue
            if record[0] > 1:
                raise ValidationError(
                    "dp.clipping",
                    f"layer {layer} ran {record[0]} times with gradients in one step; per-unit norms need one "
                    "call per layer (compute targets under torch.no_grad, or use clipping='opacus')",
                )
            taken.append((layer, record[1], record[2]))
        return taken

    def take_rows(self) -> Optional[list[tuple[int, torch.Tensor, torch.Tensor]]]:
        """(calls, input a, output) of every layer, taken, when each ran exactly once since the last take on 2-D
        rows (the common case, with nothing else to check); None otherwise, the records left for ``take``."""
        records = self.records
        try:
            taken = [records[key] for key in self._keys]
        except KeyError:  # a layer that did not run
            return None
        for calls, _, out in taken:
            if calls != 1 or out.dim() != 2:
                return None
        records.clear()
        return taken

    def discard(self) -> None:
        self.records.clear()

    def close(self) -> None:
        self.records.clear()
        self._finalizer()  # removes the hooks once; later calls do nothing


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()


@dataclass(frozen=True)
class UnitLayout:
    """How rows map onto groups, one group per unit that owns rows.

    ``kmax`` rows at most per group. With ``block`` set, groups are contiguous blocks of ``kmax`` rows, so a
    reshape forms them (the layout of a library sampler's batch). Otherwise rows are scattered into a zero-padded
    [n_units, kmax, ...] tensor, one group per unit (units owning no rows give empty groups of norm 0).
    """

    n_units: int
    kmax: int
    block: bool
    row_unit: Optional[torch.Tensor] = None  # unit of each row (scatter layout)
    order: Optional[torch.Tensor] = None
    slot: Optional[torch.Tensor] = None

    @staticmethod
    def build(unit_index: torch.Tensor, counts: torch.Tensor) -> "UnitLayout":
        n_units = len(counts)
        kmax = int(counts.max()) if n_units else 0
        if kmax <= 1:
            return UnitLayout(n_units, kmax, True)
        present = counts[counts > 0]
        blocks = unit_index[::kmax]
        if bool((present == kmax).all()) and torch.equal(unit_index, blocks.repeat_interleave(kmax)):
            return UnitLayout(n_units, kmax, True)
        order = torch.argsort(unit_index, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(order), device=unit_index.device) - starts[unit_index[order]]
        return UnitLayout(n_units, kmax, False, unit_index, order, slot)

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [R, (T,) d] -> [groups, kmax * T, d]."""
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        steps, width = x.shape[1], x.shape[2]
        if self.block:
            return x.reshape(-1, max(self.kmax, 1) * steps, width)
        out = x.new_zeros(self.n_units, self.kmax, steps, width)
        out[self.row_unit[self.order], self.slot] = x[self.order]
        return out.reshape(self.n_units, self.kmax * steps, width)

    def row_values(self, per_group: torch.Tensor) -> torch.Tensor:
        """A value per group -> the value of each row's group."""
        if not self.block:
            return per_group[self.row_unit]
        return per_group if self.kmax <= 1 else per_group.repeat_interleave(self.kmax)


def ghost_sq_norms(
    a: torch.Tensor, g: torch.Tensor, layout: UnitLayout, has_bias: bool, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Squared norms [groups] of each group's gradient of one Linear layer, from inputs a and output grads g;
    added into ``out`` when given (the sum over layers)."""
    if layout.block and layout.kmax <= 1 and a.dim() == 2:
        # One reduction pass per tensor (vecdot would write g * g out first: 4x the time at 1024 x 512).
        g_sq = torch.linalg.vector_norm(g, dim=1).square_()
        a_sq = torch.linalg.vector_norm(a, dim=1).square_()
        if out is None:
            return torch.addcmul(g_sq, g_sq, a_sq) if has_bias else g_sq.mul_(a_sq)
        if has_bias:
            out.add_(g_sq)
        return out.addcmul_(g_sq, a_sq)
    pa, pg = layout.group(a), layout.group(g)
    k, d_in, d_out = pa.shape[1], pa.shape[2], pg.shape[2]
    # ||sum_i g_i [a_i, 1]^T||^2 = sum_ij (g_i . g_j)(a_i . a_j + 1): k x k Gram products per unit (the bias is the
    # weight of a constant input 1) cost k^2 (d_in + d_out); forming the unit gradients costs k d_in d_out and
    # three passes over them, so Gram products win unless units own very many rows.
    if k * (d_in + d_out) < 4 * d_in * d_out:
        gram_a = pa @ pa.transpose(1, 2)
        if has_bias:
            gram_a += 1.0
        sq = ((pg @ pg.transpose(1, 2)) * gram_a).sum((1, 2))
    else:
        sq = torch.einsum("uko,uki->uoi", pg, pa).square().sum((1, 2))
        if has_bias:
            sq += pg.sum(1).square().sum(1)
    return sq if out is None else out.add_(sq)


def unit_values(row_values: torch.Tensor, unit_index: torch.Tensor, n_units: int) -> torch.Tensor:
    """[n_units] value of each unit from per-row values that are equal within a unit (0 for units without rows)."""
    return row_values.new_zeros(n_units).scatter_(0, unit_index.to(row_values.device).long(), row_values)


def check_row_weights(row_weights, unit_index, n_units, row_losses, blocks: Optional[int]) -> torch.Tensor:
    """``row_weights`` as a detached tensor like ``row_losses``: finite, |w| <= 1, one value per unit (one
    synchronisation for all checks). ``blocks``: units are contiguous blocks of that many rows (``RowLayout``)."""
    row_weights = torch.as_tensor(row_weights).detach().to(row_losses.device, row_losses.dtype)
    if row_weights.shape != row_losses.shape:
        raise ValidationError("row_weights", f"expected shape {tuple(row_losses.shape)}, got {tuple(row_weights.shape)}")
    bounded = row_weights.abs() <= 1  # False for NaN too
    if blocks == 1:  # one row per unit: nothing to share
        shared = bounded
    elif blocks is not None:
        grouped = row_weights.reshape(-1, blocks)
        shared = grouped == grouped[:, :1]
    else:
        shared = unit_values(row_weights, unit_index, n_units)[unit_index.to(row_weights.device).long()] == row_weights
    if not bool(bounded.all() & shared.all()):
        if not bool(bounded.all()):
            raise ValidationError("row_weights", "weights must be finite with |w| <= 1 (they scale clipped gradients)")
        raise ValidationError("row_weights", "the rows of one unit must share one weight")
    return row_weights
