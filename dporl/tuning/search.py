"""A private hyperparameter search: the best of a random number of private runs, under one guarantee.

Liu & Talwar 2019, "Private selection from private candidates"; Papernot & Steinke 2022, "Hyperparameter tuning with
Renyi differential privacy". In order, in the search's run directory (``RUN``):

1. the data are loaded once (saved, generated or imported into ``RUN/curator/data``, which every trial reads);
2. the number of units is released once for every trial (stage "unit_count", add/remove neighbours: the count's
   share of the search's epsilon, ``dporl.privacy.count``); each trial derives its rates and noise from it;
   for the methods with the stable-prefix release (``mixed``, ``stable_only``: Sharma et al. 2024, Algorithms 1-3)
   the release runs ONCE here too, after the count (its precondition is checked on the count's lower bound), as
   its own stage "release" of the search's ledger at the share the base config gives it (its runs are
   (epsilon, delta)-DP, with no Renyi curve for the selection's analysis to hold). It is journaled like a run's
   (``dporl.pipelines.train.release``): a resumed search reuses it, never releases again. D_stable and its public
   summary go to ``RUN/release/``; every trial reads them as a public input (``released_stable``) and runs no
   release of its own; the keys the release depends on are refused in the space;
3. each trial's events are planned from public inputs (``dporl.tuning.planning``) for every combination of the
   privacy-relevant choices, and the per-trial budget is calibrated: the largest whose search, ONE
   ``SelectionEvent`` over the costliest plan, fits what the count (and the release) leave of the search's budget
   (``dporl.privacy.selection``). Trials that spend nothing (``stable_only``: noiseless training on D_stable,
   returns in the public simulator) are post-processing of what the search released: no selection stage. A trial
   of some privacy class that its own run would refuse before spending (its checks on public inputs, the trial
   budget and the released count: e.g. its private evaluation's predicted noise) refuses the search here, before
   the selection is charged: such trials could never produce a score;
4. the number of trials K is drawn from the search's secret stream "search/trials"; trial i gets the secret root
   "trial/i" of the search's root (its run's ``noise_seed``) and draws its candidate from that root's stream
   "candidate"; K, the seeds and the candidates are journaled (curator-only) and the search event is CHARGED, before
   any trial runs (write-ahead: a crash can never under-count, and a resumed search reuses K, the seeds, the
   candidates and every finished trial, charging nothing twice; a trial it left unfinished starts again from
   scratch with its own seed: nothing of the unfinished attempt was released, and the rerun draws the same
   randomness, one sample of the trial as charged);
5. the trials run (``dporl.tuning.trials``: sequentially, or on Ray), each a whole private run into
   ``RUN/curator/trials/trial_NNNN`` (its own ledger at the trial budget, its stdout in ``trial_NNNN.log``); each
   trial's journaled events, finished or failed, are checked against the plan (more would void the search's
   guarantee);
6. the trial with the best score (a number of its own ``release/summary.json``: its private evaluation, or its
   return in the public simulator; failed trials rank last, ties go to the earlier trial: the trials are i.i.d.,
   so that is a uniformly random choice among the best) has its ``release/`` copied to ``RUN/release/`` (its
   TensorBoard files excepted: their wall-clock times would place the winner among the trials, i.e. bound K), with
   the search's privacy report, the selected hyperparameters (``selected.json``) and the public summary. Poisson
   K = 0, or no trial with a score, releases no policy (and does not say which); when trials ran and none scored,
   the curator is told why on stderr and in ``curator/summary.json`` (``failures``: each error, how many trials).

``RUN/curator/`` keeps every trial's run directory, ``results.csv`` and ``results.png`` (score against each
hyperparameter: private, the losing trials' scores are covered by no guarantee), the journal and the full summary
(K included). Nothing printed on stdout depends on K or on a losing trial.
"""

from __future__ import annotations

import copy
import math
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from dporl.methods.unit_level import TRAIN_STAGE
from dporl.pipelines.unit_count import count_once, describe_count
from dporl.privacy.count import ReleasedCount
from dporl.privacy.events import SelectionEvent, event_to_dict
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import ROOT_BITS, SecretRoot
from dporl.privacy.selection import TrialCount, calibrate_trial_budget, describe_search, selection_epsilon, trial_rdp
from dporl.privacy.units import dataset_unit
from dporl.train import interrupt
from dporl.train.run_dir import RunDirectory, RunMode, read_journal
from dporl.tuning.config import TuneConfig
from dporl.tuning.planning import TrialPrivacy, trial_kind
from dporl.tuning.trials import progress_bar, run_trials
from dporl.utils.config import to_dict
from dporl.utils.io import atomic_write_json, read_json
from dporl.utils.validation import PrivacyBudgetError, ValidationError

PIPELINE = "tune"
SELECTION_STAGE = "selection"
PLAN = "search"  # the journal's record of K, the trial seeds and candidates (curator-only)
TRIALS_DIR = "trials"
RELEASE_FILES = ("d_stable.npz", "release.json")  # the search's stable-prefix release (release methods)
# A trial's recorded Renyi curve may exceed the planned one by float rounding only.
CURVE_RTOL = 1e-9


def trial_name(index: int) -> str:
    return f"trial_{index:04d}"


def run_search(base: Mapping[str, Any], tune: TuneConfig, mode: RunMode = "new", dataset: Any = None) -> dict:
    """Run (or resume) the search of ``tune`` over the pipeline config ``base`` (a plain mapping); returns the
    public summary. ``dataset``: a dataset handed over in Python (``data.format: memory``)."""
    kind = trial_kind(base.get("pipeline"))
    base = copy.deepcopy(dict(base))
    config = kind.config(base)
    kind.check_base(config)
    space = tune.search_space
    kind.check_space(space, base)
    if (dataset is not None) != (config.data.format == "memory"):
        raise ValidationError("data.format", "format 'memory' is for a dataset handed over in Python, and only it "
                              "takes one")
    epsilon = config.epsilon if tune.epsilon is None else tune.epsilon
    delta = config.delta if tune.delta is None else tune.delta
    at_budget = kind.config({**base, "epsilon": epsilon, "delta": delta})  # the search's stages: count, release, trials
    budgets = at_budget.stage_budgets()
    run_dir = tune.run_dir or f"{config.run_dir.rstrip('/')}_tune"
    search_config = {"base": to_dict(config), "tune": to_dict(tune), "budget": [epsilon, delta]}
    run = RunDirectory(run_dir, pipeline=PIPELINE, config=search_config, mode=mode)
    if run.finished:
        return run.read_summary()
    run.begin()
    loaded = kind.load_data(config, run.curator / "data", dataset)
    run.check_inputs(**loaded.inputs)
    root = SecretRoot(tune.noise_seed if tune.noise_seed is not None else config.noise_seed)
    ledger = run.ledger((epsilon, delta), config.neighbours)
    unit = dataset_unit(loaded.dataset)

    release_plan = kind.plan_release(at_budget, loaded)  # the release's refusals, before the first spend

    # 2. the count, once for every trial; then the release, once for every trial
    count_plan = kind.count_plan(at_budget, loaded.dataset)
    if count_plan.cells is not None:
        ledger.partition(_trial_partition(config, loaded.dataset))
    released = count_once(run, ledger, root, count_plan, loaded.dataset, ledger.unit_partition)
    print(describe_count(released))
    stable = None
    if release_plan is not None:
        with interrupt.deferred_interrupts():  # a signal stops the search after the paid release is whole
            stable = kind.release_once(at_budget, run, ledger, root, loaded, released, release_plan)
        # Only functions of the release are printed: never a count of the private logged data.
        public = stable["public"]
        print(f"stable-prefix release (once, for every trial): {public.get('released_prefixes')} prefixes of "
              f"{public.get('runs')} runs, {public.get('stable_transitions')} transitions in D_stable")

    # 3. plan every privacy class, calibrate the trial budget, build the one search event
    count = tune.trials.count()
    # What the count (and the release) leave of the search's budget; nothing when the trials spend nothing.
    selection_budget, selection_delta = budgets.get(TRAIN_STAGE, (0.0, 0.0))
    spends = TRAIN_STAGE in budgets
    trial_delta = selection_delta if spends else delta  # (a trial that spends nothing opens no stage)
    classes = kind.privacy_classes(space)
    planners = []
    for values in classes:
        data = kind.trial_config(base, values, budget=(epsilon, trial_delta), released=released, seed=None,
                                 run_dir=str(run.curator / TRIALS_DIR / "plan"), data=loaded.trial_data,
                                 stable=stable)
        planners.append(kind.planner(data, loaded.dataset))

    def selection_of(trial_epsilon: float) -> SelectionEvent:
        parts = set()
        for plan in planners:
            parts.update(plan(trial_epsilon).parts())
        return count.event(tuple(sorted(parts, key=repr)))

    plan = run.completed(PLAN)
    if not spends:  # post-processing of the released outputs: trials at no budget, no selection event
        trial_epsilon, event = 0.0, None
    elif plan is not None:  # a resumed search: the journaled trial budget, checked against this code's event below
        trial_epsilon = float(plan["trial_epsilon"])
        event = selection_of(trial_epsilon)
    elif tune.trial_epsilon is None:
        trial_epsilon, event, spent = calibrate_trial_budget(selection_of, selection_budget, selection_delta,
                                                             upper=selection_budget)
    else:
        trial_epsilon, event = tune.trial_epsilon, selection_of(tune.trial_epsilon)
        spent = selection_epsilon(event, selection_delta)
        if spent > selection_budget:
            raise PrivacyBudgetError("trial_epsilon", f"trials at epsilon={trial_epsilon:g} make a search of "
                                     f"eps={spent:.4g} at delta={selection_delta:g}, more than the "
                                     f"{selection_budget:.4g} the count (and the release) leave of its budget; lower "
                                     "trial_epsilon (or omit it to calibrate)")

    # 4. K, the seeds and the candidates (journaled), then the charge, before any trial runs
    if plan is None:  # a trial its own run would refuse before spending is refused here, before the search spends
        _check_trials(kind, base, classes, (trial_epsilon if spends else epsilon, trial_delta), released, run,
                      loaded, stable)
        trials = count.sample(root.numpy_generator("search/trials"))
        seeds = [root.integer(f"trial/{i}", bits=ROOT_BITS) for i in range(trials)]
        candidates = [space.draw(SecretRoot(seed).numpy_generator("candidate")) for seed in seeds]
        plan = {"trials": trials, "seeds": seeds, "candidates": candidates, "trial_epsilon": trial_epsilon,
                "event": None if event is None else event_to_dict(event)}
        run.complete(PLAN, plan)
    elif plan.get("event") != (None if event is None else event_to_dict(event)):
        raise ValidationError("run_dir", f"{run.root}: the search journaled another plan than this code computes "
                              "for the same config; refusing to resume it (use a new run_dir)")
    if event is not None:
        if SELECTION_STAGE not in ledger.stages:
            ledger.stage(SELECTION_STAGE, budget=(selection_budget, selection_delta), mechanism="rdp", unit=unit,
                         analysis=describe_search(count))
        selection_stage = ledger.stages[SELECTION_STAGE]
        if not len(selection_stage.accountant):
            ledger.record(SELECTION_STAGE, event)
        elif selection_stage.accountant.history != [(event, 1)]:
            raise ValidationError("journal", "the journal charged another search than this one; refusing to resume")
    elif SELECTION_STAGE in ledger.stages:
        raise ValidationError("journal", "the journal charged a search whose trials this code plans to spend nothing; "
                              "refusing to resume")

    # 5. the trials
    trials, seeds, candidates = _check_plan(plan)
    trial_epsilon = float(plan["trial_epsilon"])
    specs = []
    for i in range(trials):
        name = trial_name(i)
        trial_dir = (run.curator / TRIALS_DIR / name).absolute()
        if run.completed(f"trial/{i}") is not None:
            continue
        data = kind.trial_config(base, candidates[i], budget=(trial_epsilon, trial_delta) if spends else
                                 (epsilon, trial_delta), released=released, seed=int(seeds[i]), run_dir=str(trial_dir),
                                 data=loaded.trial_data, stable=stable)
        # A trial an earlier attempt finished is read back; one it left unfinished starts again from scratch with the
        # same seed: its partial outputs were never released, and a rerun draws the same randomness (one sample of
        # the trial, as charged).
        mode_i = ("resume" if (trial_dir / "curator" / "summary.json").is_file() else
                  "overwrite" if trial_dir.exists() and any(trial_dir.iterdir()) else "new")
        specs.append({"index": i, "pipeline": kind.pipeline, "config": data, "mode": mode_i,
                      "threads": tune.threads_per_trial, "log": str(trial_dir.parent / f"{name}.log")})
    planned_curve = trial_rdp(event.trial) if event is not None else np.zeros(1)
    bar = progress_bar(trials, tune.progress)
    bar.update(trials - len(specs))

    def on_done(spec: dict[str, Any], outcome: dict[str, Any]) -> None:
        i = spec["index"]
        record = {"status": outcome["status"], "error": outcome["error"], "seconds": outcome["seconds"],
                  "score": None}
        trial_dir = Path(spec["config"]["run_dir"])
        journal = trial_dir / "curator" / "journal.json"
        if journal.is_file():  # what the trial charged, done or failed (its write-ahead journal)
            parts = TrialPrivacy.from_ledger(read_journal(journal)).parts()
            realised = trial_rdp(parts) if any(parts) else np.zeros(1)
            if np.any(realised > planned_curve * (1 + CURVE_RTOL) + 1e-12):
                ledger.void("a trial's ledger recorded more than the search planned and charged for it")
        if outcome["status"] == "done":
            summary = read_json(trial_dir / "release" / "summary.json", "trial.summary")
            try:
                record["score_key"], record["score"] = kind.score(summary, tune.score.key)
            except ValidationError as exc:
                record.update(status="failed", error=str(exc))
        run.complete(f"trial/{i}", record)
        bar.update(1)

    try:
        run_trials(specs, on_done, workers=tune.workers, address=tune.ray_address, threads=tune.threads_per_trial)
    finally:
        bar.close()

    # 6. selection and release
    records = [run.completed(f"trial/{i}") for i in range(trials)]
    winner = _best(records, tune.score.maximize)
    return _finish(run, ledger, kind, tune, space, count, released, plan, records, winner, epsilon, delta,
                   trial_delta if spends else 0.0, None if stable is None else stable["public"])


def _check_trials(kind, base: Mapping[str, Any], classes: list[dict[str, Any]], budget: tuple[float, float],
                  released: ReleasedCount, run: RunDirectory, loaded, stable: Optional[dict[str, Any]]) -> None:
    """Refuse the search, before its selection is charged, when a trial of some privacy class would be refused by
    its own run before spending (a function of public inputs, the trial budget and the released count only): such
    trials could never produce a score, and a search whose every trial fails still pays for its selection. The
    refusal keeps the trial's field and names the class."""
    refused = []
    for values in classes:
        data = kind.trial_config(base, values, budget=budget, released=released, seed=None,
                                 run_dir=str(run.curator / TRIALS_DIR / "plan"), data=loaded.trial_data, stable=stable)
        try:
            kind.check_trial(data, loaded)
        except ValidationError as exc:
            refused.append((values, exc))
    if not refused:
        return
    exc = refused[0][1]
    if len(refused) == len(classes):
        scope, remedy = "every trial", ""
    else:
        which = "; ".join(", ".join(f"{k}={_short(v)}" for k, v in values.items()) for values, _ in refused)
        scope, remedy = f"the trials with {which}", "drop these choices from the space, or "
    reason = str(exc).split(": ", 1)[-1]
    raise type(exc)(exc.field, f"{scope} of this search would be refused by its own run before spending, at the trial "
                    f"budget (eps={budget[0]:.4g}, delta={budget[1]:g}) and the released count: {reason}. The search "
                    f"charged nothing for its trials (only what it released before them); {remedy}raise the search's "
                    "budget or lower the expected number of trials (a larger trial budget)") from None


def _check_plan(plan: Any) -> tuple[int, list[int], list[dict[str, Any]]]:
    """K, the seeds and the candidates a journal holds, checked (the journal is a file like any other)."""
    trials = plan.get("trials") if isinstance(plan, dict) else None
    seeds, candidates = plan.get("seeds"), plan.get("candidates")
    if (isinstance(trials, bool) or not isinstance(trials, int) or trials < 0 or not isinstance(seeds, list)
            or not isinstance(candidates, list) or len(seeds) != trials or len(candidates) != trials
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
            or not all(isinstance(c, dict) for c in candidates)):
        raise ValidationError("journal", "the search's journaled plan (trials, seeds, candidates) is malformed; "
                              "refusing to resume it")
    return trials, seeds, candidates


def _trial_partition(config, dataset):
    from dporl.pipelines.train import training_plan

    return training_plan(config, dataset)[2].partition


def _best(records: list[dict[str, Any]], maximize: bool) -> Optional[int]:
    """The index of the best score (failed or non-finite last; ties: the earliest), or None."""
    best, best_value = None, -math.inf
    for i, record in enumerate(records):
        score = record.get("score")
        if record.get("status") != "done" or score is None or not math.isfinite(score):
            continue
        value = score if maximize else -score
        if value > best_value:
            best, best_value = i, value
    return best


def _finish(run: RunDirectory, ledger: PrivacyLedger, kind, tune: TuneConfig, space, count: TrialCount,
            released: ReleasedCount, plan: dict[str, Any], records: list[dict[str, Any]], winner: Optional[int],
            epsilon: float, delta: float, trial_delta: float, stable: Optional[dict[str, Any]] = None) -> dict:
    from dporl.pipelines.unit_count import with_released_count
    from dporl.tuning.results import copy_release, write_results

    report = ledger.report()
    privacy = with_released_count(report.to_dict(), released)
    trial_budget = {"epsilon": float(plan["trial_epsilon"]), "delta": trial_delta}
    for entry in run.release.iterdir():  # a resumed search writes its release again from scratch (the
        if entry.name in RELEASE_FILES and stable is not None:  # stable-prefix release, journaled, is kept)
            continue
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    selected, winner_summary, headline = None, None, {}
    if winner is not None:
        trial_release = run.curator / TRIALS_DIR / trial_name(winner) / "release"
        winner_summary = read_json(trial_release / "summary.json", "trial.summary")
        copy_release(trial_release, run.release, privacy)
        selected = {
            "hyperparameters": plan["candidates"][winner],
            "score": {"key": records[winner]["score_key"], "value": records[winner]["score"],
                      "maximize": tune.score.maximize,
                      "note": "the largest of the trials' scores: as an estimate of the selected policy's value it is "
                              "biased in its favour (selection)"},
        }
        atomic_write_json(run.release / "selected.json", {**selected, "space": space.to_dict(),
                                                          "trials": count.to_dict(), "trial_budget": trial_budget})
        headline["selected hyperparameters"] = ", ".join(f"{k}={_short(v)}" for k, v in selected["hyperparameters"]
                                                         .items())
        headline.update(winner_summary.get("headline") or {})
    else:
        headline["selected"] = "none: no trial produced a score (or none ran), so no policy is released"
    atomic_write_json(run.release / "privacy_report.json", privacy)
    public = {
        "pipeline": PIPELINE,
        "base_pipeline": kind.pipeline,
        "budget": {"epsilon": epsilon, "delta": delta},
        "trial_budget": trial_budget,
        "trials": count.to_dict(),
        "space": space.to_dict(),
        "selected": selected,
        "selected_summary": None if winner_summary is None else
        {k: v for k, v in winner_summary.items() if k != "privacy"},
        "unit_count": released.to_dict(),
        "release": stable,
        "privacy": privacy,
        "headline": headline,
    }
    rows = write_results(run.curator, records, plan["candidates"], space, winner)
    failures = _failures(records)
    run.write_summaries(public, {**public, "run_dir": str(run.root), "config": run.config, "trials_run": len(records),
                                 "results": rows, "failures": failures})
    if winner is None and failures:  # on stderr, beside the progress bar: it counts the trials (curator-only)
        first = next(iter(failures))
        print(f"search (curator-only: never share): no trial produced a score; {sum(failures.values())} of "
              f"{len(records)} trials failed ({len(failures)} distinct error(s); e.g. {first}); each trial's log is "
              f"{run.curator / TRIALS_DIR}/trial_NNNN.log. The search's budget was spent on them.", file=sys.stderr)
    print(report.describe())
    print(f"release (safe to share): {run.release}; curator-only (never share): {run.curator}")
    return public


def _failures(records: list[dict[str, Any]]) -> dict[str, int]:
    """The trials' errors (curator-only) and how many trials failed with each, in trial order."""
    failures: dict[str, int] = {}
    for record in records:
        score = record.get("score")
        if record.get("status") != "done" or score is None or not math.isfinite(score):
            error = str(record.get("error") or f"score {score!r}")
            failures[error] = failures.get(error, 0) + 1
    return failures


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


__all__ = ["PIPELINE", "SELECTION_STAGE", "run_search"]
