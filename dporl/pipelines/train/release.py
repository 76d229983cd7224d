"""The stable-prefix release of a "train" run (Sharma et al. 2024, Algorithms 1-2), paid once per run directory.

The release stage's events are journaled before any query is answered; its artifacts (D_stable and its public
summary in release/, which expert each run followed in curator/) are written next; then the journal marks it
complete with D_stable's fingerprint. A resumed run reuses a complete release, or one whose files an earlier attempt
wrote whole before it stopped, and refuses one that was charged but not written, or files no journal event pays for.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from dporl.algos.stable_prefix import RELEASE_STAGE, ReleasePlan, account, release_stable_prefixes
from dporl.data.dataset import TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.pipelines import curator_note
from dporl.pipelines.train.config import TrainPipelineConfig
from dporl.privacy.count import Units
from dporl.privacy.events import event_to_dict
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.train.run_dir import RunDirectory
from dporl.utils.io import read_json
from dporl.utils.validation import PrivacyBudgetError, ValidationError


def run_release(
    dataset: TrajectoryDataset,
    experts: Optional[ExpertSet],
    budget: tuple[float, float],
    config: TrainPipelineConfig,
    ledger: PrivacyLedger,
    run: RunDirectory,
    root: SecretRoot,
    units: Units,
    plan: ReleasePlan,
) -> tuple[TrajectoryDataset, dict[str, Any]]:
    """(D_stable, the release's public summary); a paid release of this run is reused, never repeated. The
    precondition m p_min >= G0 is checked on ``units`` (the released count's lower bound, or the public count).

    Order (write-ahead): the release stage's T events are journaled before any query is answered (the ledger is
    the run's journaled ledger), then the artifacts are written (D_stable and its public summary to release/, which
    expert each run followed to curator/), then the journal marks the release complete with D_stable's
    fingerprint. A resumed run reuses a complete release after checking that the journal charges exactly the T
    events ``plan`` (the release's plan, ``plan_release``) records, that ``release.json`` says T runs and that
    D_stable is the one the journal fingerprinted; an attempt that was authorised but never completed has spent its
    budget, and a second release is refused rather than left uncounted; release files without their journal events
    are refused too. D_unstable is the whole logged dataset (the release never reads it): nothing to write.
    """
    expected = PrivacyLedger(relation=ledger.relation)
    account(plan, expected)  # the events this configuration's release records
    expected_history = (expected.stages[RELEASE_STAGE].accountant.history if RELEASE_STAGE in expected.stages
                        else [])
    manifest = run.completed(RELEASE_STAGE)
    if manifest is not None:
        check_recorded(ledger, RELEASE_STAGE, [e for e, _ in expected_history], run.journal_path,
                       exactly=sum(c for _, c in expected_history))
        public = read_json(run.release / "release.json", "release")
        if not isinstance(public, dict) or public.get("runs") != config.release.trajectories or \
                manifest.get("public", {}).get("runs") != config.release.trajectories:
            raise ValidationError(
                "release", f"{run.release / 'release.json'} or the release manifest in {run.journal_path} does not "
                f"record the {config.release.trajectories} runs this configuration releases: refusing to train on "
                "a release whose size the journal and the files disagree on"
            )
        stable = TrajectoryDataset.load(run.release / "d_stable.npz")
        if stable.fingerprint() != manifest["d_stable"] or stable.n_episodes > config.release.trajectories:
            raise ValidationError("release", f"the release files in {run.root} differ from the release its journal "
                                  "recorded: refusing to train on them")
        return stable, manifest["public"]
    if RELEASE_STAGE in ledger.stages and len(ledger.stages[RELEASE_STAGE].accountant):
        check_recorded(ledger, RELEASE_STAGE, [e for e, _ in expected_history], run.journal_path,
                       exactly=sum(c for _, c in expected_history))
        written = _written_release(run, plan, config)
        if written is not None:  # stopped after its files, before its completion mark: the paid release, reused
            return written
        raise PrivacyBudgetError(
            "release",
            f"an earlier attempt of this run authorised the stable-prefix release (its events are charged in "
            f"{run.journal_path}) but did not finish writing it; a second release would not fit the budget. Start a "
            "new run_dir (or --overwrite: the interrupted attempt's spend is then not part of the new guarantee)",
        )
    check_no_orphan_release(run, ledger)
    result = release_stable_prefixes(
        dataset, experts, epsilon=budget[0], delta=budget[1], config=config.release, root=root, ledger=ledger,
        progress=config.trainer.progress, units=units,
    )
    result.save(run.release, run.curator)
    if experts is not None and experts.repaired_queries:
        curator_note(f"the release lifted {experts.repaired_queries} (expert, state) distributions below p_min to "
                     "p_min (mixing with the uniform policy) instead of refusing them")
    public = result.summary()
    run.complete(RELEASE_STAGE, {"public": public, "d_stable": result.stable.fingerprint()})
    return result.stable, public


def check_no_orphan_release(run: RunDirectory, ledger: PrivacyLedger) -> None:
    """Refuse release files that no journal event pays for (checked before the run spends anything): a journal put
    back from before the release, or files copied in; releasing again would leave the first release uncounted."""
    if RELEASE_STAGE in ledger.stages and len(ledger.stages[RELEASE_STAGE].accountant):
        return
    left = [name for name in ("d_stable.npz", "release.json") if (run.release / name).exists()]
    if left:
        raise ValidationError(
            "release", f"{run.release} holds {', '.join(left)} but the journal records no release: a release "
            "artifact without its journal events; refusing to release again. Start a new run_dir (or --overwrite)"
        )


def _written_release(run: RunDirectory, plan: ReleasePlan, config: TrainPipelineConfig
                     ) -> Optional[tuple[TrajectoryDataset, dict[str, Any]]]:
    """The release an earlier attempt charged and wrote whole (D_stable, then release.json: each written atomically)
    but did not mark complete, or None when its files are not all there. Its public summary must be the one this
    configuration's plan produces; it is then marked complete, never run again."""
    d_stable, summary = run.release / "d_stable.npz", run.release / "release.json"
    if not (d_stable.is_file() and summary.is_file()):
        return None
    stable = TrajectoryDataset.load(d_stable)
    public = read_json(summary, "release")
    expected = {"source": plan.source, "runs": plan.trajectories, "released_prefixes": stable.n_episodes,
                "stable_transitions": stable.n_transitions, "epsilon_prime": plan.budget.epsilon_prime,
                "beta": plan.budget.beta, "threshold": plan.budget.threshold, "noise_scale": plan.budget.noise_scale}
    if not isinstance(public, dict) or any(public.get(key) != value for key, value in expected.items()) \
            or stable.n_episodes > plan.trajectories:
        raise ValidationError("release", f"{summary} does not describe the release this configuration charged: "
                              "refusing to train on it or to release again. Start a new run_dir (or --overwrite)")
    if not (run.curator / "release_runs.json").is_file():
        print("release: the curator's record of which expert each run followed was not written before the stop; "
              "it is lost (the release itself is whole)", file=sys.stderr)
    print("release: an earlier attempt charged and wrote the stable-prefix release but stopped before marking it "
          "complete: reusing it (charged once, never run again)", file=sys.stderr)
    run.complete(RELEASE_STAGE, {"public": public, "d_stable": stable.fingerprint()})
    return stable, public


def check_recorded(ledger: PrivacyLedger, stage: str, events: list, journal: Path,
                   exactly: Optional[int] = None) -> None:
    """Refuse a journal whose ``stage`` charged other events than ``events`` (what this configuration produces), or,
    with ``exactly``, another number of them: the journal was edited, or is not this configuration's."""
    if stage not in ledger.stages:
        if exactly:
            raise ValidationError(f"journal.{stage}", f"{journal} records no stage {stage!r}, which this run "
                                  "completed: refusing to resume")
        return
    history = ledger.stages[stage].accountant.history
    foreign = [event for event, _ in history if event not in events]
    count = sum(c for _, c in history)
    if foreign or (exactly is not None and count != exactly):
        raise ValidationError(
            f"journal.{stage}", f"{journal} records {count} events {[event_to_dict(e) for e in foreign][:2] or ''} "
            f"in stage {stage!r}, but this configuration "
            f"{'charges exactly ' + str(exactly) + ' of ' if exactly is not None else 'charges '}"
            f"{[event_to_dict(e) for e in events]}: refusing to resume from a journal that does not say what this run "
            "spent"
        )
