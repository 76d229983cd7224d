"""The write-ahead journal and saved state of a privacy ledger (``dporl.privacy.ledger``).

With a journal attached (``attach_journal``), every change of the ledger's state (a stage opened, an event charged,
a paper claim, a void) is handed to the journal BEFORE the call returns, so a mechanism runs only after its cost is
durable. Recovery loads the journal: every authorised event is charged as recorded, run or not (a crash can never
under-count, and a re-run can never re-price what an earlier attempt authorised). ``state_dict`` /
``load_state_dict`` save and restore the whole ledger as JSON-safe values; a restored state is checked against the
budgets like fresh charges, so no state on disk can produce a guarantee above the budget.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from dporl.privacy.accountants import within_budget
from dporl.privacy.ledger_report import PaperClaim
from dporl.privacy.ledger_stages import check_flag
from dporl.privacy.partition import UnitPartition
from dporl.privacy.units import PrivacyUnit, Relation
from dporl.utils.validation import PrivacyBudgetError, ValidationError


class LedgerJournal:
    """The persistence half of ``PrivacyLedger`` (its journal, ``state_dict`` and restore); a ledger is both."""

    _journal: Optional[Callable[[dict[str, Any]], None]]

    @property
    def journaled(self) -> bool:
        return self._journal is not None

    def attach_journal(self, write: Callable[[dict[str, Any]], None], recovered: Optional[dict[str, Any]] = None) -> None:
        """Hand every later change of the state to ``write`` (with the whole ``state_dict()``) before it takes effect.

        ``recovered`` is the state a journal held from an earlier attempt: all its events are charged as recorded,
        and whatever this ledger holds already (recorded before the journal was attached) is charged on top (a
        pipeline that repeats a mechanism on resume pays for it twice, never zero times).
        """
        if self._journal is not None:
            raise ValidationError("ledger.journal", "a journal is already attached")
        if recovered is not None:
            self._merge(recovered)
        self._journal = write
        self._write()

    def _write(self) -> None:
        if self._journal is not None:
            self._journal(self.state_dict())

    def _merge(self, recovered: dict[str, Any]) -> None:
        """This ledger := ``recovered`` plus every stage, event and claim this ledger holds (budgets checked)."""
        merged = type(self)(self.budget, self.relation)
        merged.load_state_dict(recovered)
        if merged.relation != self.relation:
            raise ValidationError("journal", f"the journal on disk is for {merged.relation} neighbours, this run's "
                                  f"guarantee is for {self.relation}")
        if self.unit_partition is not None:
            merged.partition(self.unit_partition)  # a different partition on disk is refused
        for assumption in self.assumptions:
            merged.assume(assumption)
        for name, s in self.stages.items():
            if name in merged.stages:
                other = merged.stages[name]
                if (other.budget, other.mechanism, other.unit, other.delta, other.shares_run_budget) != (
                    s.budget, s.mechanism, s.unit, s.delta, s.shares_run_budget
                ):
                    raise ValidationError(
                        "journal", f"stage {name!r} on disk ({other.budget}, {other.mechanism}, {other.unit}, shares "
                        f"the run budget: {other.shares_run_budget}) differs from this run's ({s.budget}, "
                        f"{s.mechanism}, {s.unit}, {s.shares_run_budget})"
                    )
            else:
                merged.stage(name, budget=s.budget, mechanism=s.mechanism, unit=s.unit,
                             delta=None if s.budget else s.delta, cells=s.cells,
                             shares_run_budget=s.shares_run_budget)
                merged.stages[name].analysis = s.analysis
            for event, count in s.accountant.history:
                merged._charge(name, event, count)
        for claim in self.paper_claims:
            if claim not in merged.paper_claims:
                merged.paper_claims.append(claim)
        if self.void_reason is not None:
            merged.void(self.void_reason)
        self.stages, self.paper_claims, self.void_reason = merged.stages, merged.paper_claims, merged.void_reason
        self.unit_partition, self.assumptions = merged.unit_partition, merged.assumptions
        self.budget = merged.budget

    def state_dict(self) -> dict[str, Any]:
        return {
            "stages": [
                {
                    "name": s.name,
                    "budget": list(s.budget) if s.budget else None,
                    "mechanism": s.mechanism,
                    "unit": s.unit.to_dict(),
                    "delta": s.delta,
                    "analysis": s.analysis,
                    "accountant": s.accountant.state_dict(),
                    "cells": None if s.cells is None else list(s.cells),
                    "shares_run_budget": s.shares_run_budget,
                }
                for s in self.stages.values()
            ],
            "paper_claims": [claim.to_dict() for claim in self.paper_claims],
            "void": self.void_reason,
            "budget": list(self.budget) if self.budget else None,
            "partition": None if self.unit_partition is None else self.unit_partition.to_dict(),
            "assumptions": list(self.assumptions),
            "relation": self.relation.value,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state (a JSON-safe dict). Every restored stage and event is checked against this ledger's
        run budget (the saved one when this ledger has none) and each stage's own, so no state on disk can produce a
        guarantee above the budget; a malformed state is a ValidationError naming "ledger", never a KeyError."""
        try:
            restored = self._restore(state)
        except ValidationError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValidationError("ledger", f"saved ledger state is malformed ({type(exc).__name__}: {exc})") from None
        self.stages, self.paper_claims, self.void_reason = restored.stages, restored.paper_claims, restored.void_reason
        self.unit_partition, self.assumptions = restored.unit_partition, restored.assumptions
        self.budget, self.relation = restored.budget, restored.relation
        self._ahead = {}
        self._write()

    def _restore(self, state: dict[str, Any]) -> "LedgerJournal":
        if not isinstance(state, dict) or not isinstance(state["stages"], list):
            raise ValidationError("ledger", f"expected a saved ledger state, got {type(state).__name__}")
        saved_budget = state.get("budget")
        if self.budget is not None and saved_budget is not None and tuple(saved_budget) != self.budget:
            raise PrivacyBudgetError(
                "ledger.budget", f"the saved ledger was made for a run budget {tuple(saved_budget)}, this run's is "
                f"{self.budget}"
            )
        # A ledger without a run budget of its own (e.g. one reading a journal) takes the saved one.
        budget = self.budget if self.budget is not None or saved_budget is None else saved_budget
        restored = type(self)(budget, state.get("relation", Relation.ADD_REMOVE.value))
        if state.get("partition") is not None:
            restored.partition(UnitPartition.from_dict(state["partition"]))
        assumptions = state.get("assumptions", [])
        if not isinstance(assumptions, list) or not all(isinstance(a, str) and a for a in assumptions):
            raise ValidationError("ledger.assumptions", f"must be a list of non-empty strings, got {assumptions!r}")
        restored.assumptions = list(assumptions)
        for entry in state["stages"]:
            budget = tuple(entry["budget"]) if entry["budget"] is not None else None
            s = restored.stage(
                entry["name"], budget=budget, mechanism=entry["mechanism"], unit=PrivacyUnit.from_dict(entry["unit"]),
                delta=None if budget else entry["delta"], cells=entry.get("cells"),
                shares_run_budget=check_flag(entry.get("shares_run_budget", False)),
            )
            if not isinstance(entry["analysis"], str):
                raise ValidationError("ledger", f"stage {s.name!r}: analysis must be a string")
            s.analysis = entry["analysis"]
            s.accountant.load_state_dict(entry["accountant"])
            own = s.budget is not None and not s.shares_run_budget  # a sharing stage: the run's check below
            if own and not within_budget(restored.spent(s.name), s.budget[0]):
                raise PrivacyBudgetError(
                    f"ledger.{s.name}", f"the saved state spends eps={restored.spent(s.name):.4g}, over the stage "
                    f"budget eps={s.budget[0]:g}: refusing to load it"
                )
        if restored._sharing() and not restored._run_fits(restored._report()):
            raise PrivacyBudgetError(
                "ledger.budget", f"the saved state puts the run past its budget {restored.budget}: refusing to load it"
            )
        restored.paper_claims = [
            PaperClaim(str(c["name"]), float(c["epsilon"]), float(c["delta"]), str(c["source"]))
            for c in state.get("paper_claims", [])
        ]
        void = state.get("void")
        if void is not None and not isinstance(void, str):
            raise ValidationError("ledger.void", f"must be a string or null, got {void!r}")
        restored.void_reason = void
        return restored

