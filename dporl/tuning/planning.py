"""What a trial of a search spends, before it runs: the events its ledger will record, per stage and cell.

The search's ledger charges ONE ``SelectionEvent`` before any trial runs (write-ahead: a crash can never under-count),
so the trial's events must be known in advance, for every candidate a trial may draw. They are functions of public
inputs only (the config and the released count of the units), and this module computes them with the pipeline's
own planning functions (the calibration its run performs). After each trial ran, the search reads the events its
ledger actually recorded (``TrialPrivacy.from_report``, from the trial's privacy report) and checks that their Renyi
curve stays under the planned one; a trial that spent more voids the search's guarantee instead of being passed off.

A pipeline a search may tune is a ``TrialKind``: the keys it refuses to tune (they fix the data, the budget, the
relation or the evaluation every trial is compared by), the keys that change a trial's privacy (tunable as
``choices`` only: the search plans every combination and covers the costliest), the data every trial reads (loaded
and counted once), the count the search releases for all trials, each trial's config, and its score. For the
methods with a stable-prefix release (``stable_only``, ``mixed``) the release is the search's too: run once before
the trials, with its own accounted stage (its runs are (epsilon, delta)-DP and have no Renyi curve, so they cannot
sit inside the selection's analysis), and read by every trial as a public input; the keys it depends on are refused
in a space.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from dporl.privacy.count import CountPlan, ReleasedCount
from dporl.privacy.events import PoissonGaussianEvent, PrivacyEvent, event_from_dict
from dporl.tuning.space import SearchSpace, get_key, set_key
from dporl.utils.validation import ValidationError


# ---------------------------------------------------------------------------------------------------- trial events
@dataclass(frozen=True)
class PlannedStage:
    name: str
    events: tuple[tuple[PrivacyEvent, int], ...]
    cells: Optional[tuple[str, ...]] = None  # cells of the trial's partition it touches (None: every unit)


@dataclass(frozen=True)
class TrialPrivacy:
    """A trial's stages and the cells of its partition (empty: no partition)."""

    stages: tuple[PlannedStage, ...]
    cells: tuple[str, ...] = ()

    def parts(self) -> tuple:
        """The trial as a ``SelectionEvent`` holds it: per cell, the events of the stages touching it (one part
        without cells); identical parts once, in a canonical order."""
        names = self.cells or (None,)
        parts = set()
        for cell in names:
            events: dict[PrivacyEvent, int] = {}
            for stage in self.stages:
                if cell is None or stage.cells is None or cell in stage.cells:
                    for event, count in stage.events:
                        if count:
                            events[event] = events.get(event, 0) + int(count)
            parts.add(tuple(sorted(events.items(), key=repr)))
        return tuple(sorted(parts, key=repr))

    @staticmethod
    def from_ledger(ledger: Any) -> "TrialPrivacy":
        """The events a trial's ledger holds (e.g. read back from its write-ahead journal)."""
        stages = tuple(PlannedStage(s.name, tuple((e, int(c)) for e, c in s.accountant.history), s.cells)
                       for s in ledger.stages.values())
        cells = () if ledger.unit_partition is None else tuple(ledger.unit_partition.names)
        return TrialPrivacy(stages, cells)

    @staticmethod
    def from_report(report: Any) -> "TrialPrivacy":
        """The events a trial's ledger recorded, from its ``privacy_report.json`` (validated: a malformed report is
        a ValidationError naming it)."""
        try:
            stages = []
            for stage in report["stages"]:
                events = tuple((event_from_dict(dict(event)), int(count)) for event, count in stage["events"])
                cells = None if stage.get("cells") is None else tuple(str(c) for c in stage["cells"])
                stages.append(PlannedStage(str(stage["name"]), events, cells))
            partition = report.get("partition")
            cells = () if partition is None else tuple(str(name) for name, _ in partition["cells"])
        except ValidationError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValidationError("trial.privacy_report", f"not a privacy report ({type(exc).__name__}: {exc})") from None
        return TrialPrivacy(tuple(stages), cells)


def _fingerprints(dataset: Any, experts: Any) -> dict[str, str]:
    return {"dataset": dataset.fingerprint(), **({"expert_set": experts.fingerprint()} if experts is not None else {})}


def _is_under(key: str, prefixes: tuple[str, ...]) -> Optional[str]:
    for prefix in prefixes:
        if key == prefix or key.startswith(prefix + "."):
            return prefix
    return None


# ---------------------------------------------------------------------------------------------------- train
@dataclass
class LoadedData:
    """The data every trial reads: the dataset (for counting and planning), the ``data`` section each trial's config
    gets (a file the search saved or generated once), and the input hashes of the search's provenance."""

    dataset: Any
    trial_data: dict[str, Any]
    inputs: dict[str, str]
    experts: Any = None  # the expert set that logged the data (the release methods), else None


class TrainTrials:
    """Trials of the ``train`` pipeline (any registered algorithm) under add/remove neighbours with a private
    method: ``dp_sgd`` (each trial's events are Renyi-accounted), or ``mixed`` / ``stable_only``, whose
    stable-prefix release (its (eps, delta) runs have no Renyi curve) the search runs once before the trials and
    every trial reads as a public input (``released_stable``): a ``mixed`` trial's mixture steps are
    Renyi-accounted, a ``stable_only`` trial spends nothing (noiseless training on D_stable, returns in the public
    simulator: post-processing of what the search released)."""

    pipeline = "train"
    # The data, the budget, the relation and the evaluation are the search's: the same for every trial.
    FIXED = ("pipeline", "run_dir", "noise_seed", "epsilon", "delta", "relation", "count_fraction", "released_count",
             "released_stable", "method", "data", "eval")
    # What the stable-prefix release depends on (its share of the budget, its runs, threshold, noise and horizon):
    # the search releases it once, before any trial, so no trial may change it.
    RELEASE = ("release", "release_fraction")
    # Keys whose values change a trial's events (the rate B / m~, the steps, the noise, the analysis calibrating it).
    PRIVACY = ("batch_size", "trainer.max_steps", "dp.noise_multiplier", "dp.accountant", "dp.p_dp")

    def config(self, data: Mapping[str, Any]):
        from dporl.pipelines.train import TrainPipelineConfig
        from dporl.utils.config import from_dict

        return from_dict(TrainPipelineConfig, data)

    def check_base(self, config) -> None:
        method = config.method_spec
        if not method.private:
            raise ValidationError("method", f"a private search tunes a private method (dp_sgd, mixed, stable_only); "
                                  f"{config.method!r} makes no privacy claim for a search to compose")
        if method.release and config.data.format != "npz":
            raise ValidationError("method", f"{config.method!r} runs the stable-prefix release, which queries the experts "
                                  "that logged an expert dataset (data.format npz) and rolls them out in a public "
                                  f"simulator; data.format {config.data.format!r} has neither: tune dp_sgd")
        if method.release and config.release.source != "fresh":
            raise ValidationError("release.source", "the logged variant of the release has no guarantee for a search "
                                  "to compose: use release.source fresh")
        if config.relation != "add_remove":
            raise ValidationError("relation", "a private search needs add/remove neighbours: replace-one events are "
                                  "analysed by their privacy loss distribution and have no Renyi curve here")

    def check_space(self, space: SearchSpace, base: Mapping[str, Any]) -> None:
        """Refuse (by key) what may not be tuned, privacy keys drawn from ranges, and values the config refuses."""
        for dimension in space.dimensions:
            release = _is_under(dimension.key, self.RELEASE)
            if release is not None:
                raise ValidationError(f"space.{dimension.key}", f"{release!r} configures the stable-prefix release, "
                                      "which the search runs once before its trials (its own accounted stage, read by "
                                      "every trial as a public input): a trial cannot change it, nor release again")
            fixed = _is_under(dimension.key, self.FIXED)
            if fixed is not None:
                raise ValidationError(f"space.{dimension.key}", f"{fixed!r} is the search's, the same for every trial "
                                      "(the data, the budget, the relation and the evaluation trials are compared by)")
            if _is_under(dimension.key, self.PRIVACY) and not dimension.finite:
                raise ValidationError(f"space.{dimension.key}", "changes each trial's privacy: give it as choices (the "
                                      "search plans every combination before any trial runs)")
            for value in dimension.extremes():
                data = set_key(copy.deepcopy(dict(base)), dimension.key, value)
                try:
                    self.config(data)
                except ValidationError as exc:
                    raise ValidationError(f"space.{dimension.key}", f"{value!r}: {exc}") from None

    def privacy_classes(self, space: SearchSpace) -> list[dict[str, Any]]:
        """Every combination of the privacy keys' choices (one empty class without any)."""
        classes: list[dict[str, Any]] = [{}]
        for dimension in space.dimensions:
            if _is_under(dimension.key, self.PRIVACY):
                classes = [{**c, dimension.key: value} for c in classes for value in dict.fromkeys(dimension.values)]
        return classes

    # ------------------------------------------------------------------ data and count
    def load_data(self, config, out_dir: Path, dataset: Any = None) -> LoadedData:
        """Load (or generate, or import) the data once into ``out_dir`` (the search's curator/data)."""
        from dporl.data.dataset import TrajectoryDataset
        from dporl.pipelines.train import load_data
        from dporl.pipelines.inputs import import_dataset, save_imported

        data = config.data
        release = config.method_spec.release
        if data.format == "npz" and data.generate is None:
            dataset, experts = load_data(data, out_dir, need_experts=release)
            trial_data = {"format": "npz", "path": os.path.abspath(data.npz_path), "mmap": data.mmap}
            return LoadedData(dataset, trial_data, _fingerprints(dataset, experts), experts)
        if data.format == "npz":
            from dporl.experts.expert_set import ExpertSet
            from dporl.pipelines.train import generate_dataset

            path, expert_path = generate_dataset(data.generate, out_dir)
            dataset = TrajectoryDataset.load(path)
            experts = ExpertSet.load(data.expert_set or expert_path) if release else None
            trial_data = {"format": "npz", "path": os.path.abspath(path)}
            return LoadedData(dataset, trial_data, _fingerprints(dataset, experts), experts)
        frame = None
        if dataset is None:
            dataset, frame = import_dataset(data, progress=False)
        path = save_imported(dataset, Path(out_dir), frame)
        return LoadedData(dataset, {"format": "npz", "path": os.path.abspath(path)}, _fingerprints(dataset, None))

    def count_plan(self, config, dataset) -> CountPlan:
        """The count the search releases for its trials (``config``: the base at the search's budget): one per cell
        of the trials' evaluation partition, with the failure of its lower bound when the release checks one."""
        from dporl.pipelines.train import training_plan

        _, _, plan = training_plan(config, dataset)
        epsilon, delta = config.count_budget()
        return CountPlan(epsilon, None if plan is None or plan.partition is None else plan.partition.names, delta / 2)

    def plan_release(self, config, loaded: LoadedData):
        """The search's release plan (``config``: the base at the search's budget; every refusal of the release,
        before anything is spent; its precondition waits for the count), or None for a method without one."""
        from dporl.algos.stable_prefix import RELEASE_STAGE, plan_release

        budgets = config.stage_budgets()
        if RELEASE_STAGE not in budgets:
            return None
        eps1, delta1 = budgets[RELEASE_STAGE]
        return plan_release(loaded.dataset, loaded.experts, epsilon=eps1, delta=delta1, config=config.release,
                            defer_precondition=True, relation=config.neighbours)

    def release_once(self, config, run, ledger, root, loaded: LoadedData, released: ReleasedCount, plan
                     ) -> dict[str, Any]:
        """Run the search's release in its run directory (its own stage of the search's ledger, journaled before
        any query), or reuse the one its journal recorded: never twice. Its precondition is checked on the released
        count. Returns what every trial's config gets as ``released_stable``."""
        from dporl.algos.stable_prefix import RELEASE_STAGE, check_precondition
        from dporl.pipelines.train.release import run_release

        units = released.units()
        check_precondition(plan, units)
        stable, public = run_release(loaded.dataset, loaded.experts, config.stage_budgets()[RELEASE_STAGE], config,
                                     ledger, run, root, units, plan)
        return {"path": os.path.abspath(run.release / "d_stable.npz"), "fingerprint": stable.fingerprint(),
                "public": public}

    # ------------------------------------------------------------------ trials
    def trial_config(self, base: Mapping[str, Any], candidate: Mapping[str, Any], *, budget: tuple[float, float],
                     released: Optional[ReleasedCount], seed: Optional[int], run_dir: str, data: Mapping[str, Any],
                     stable: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """A trial's config: the base with the candidate's values, the trial budget, its secret seed, its run
        directory, the search's data, count and release (``stable``: the release methods)."""
        result = copy.deepcopy(dict(base))
        for key, value in candidate.items():
            set_key(result, key, value)
        result.update(epsilon=float(budget[0]), delta=float(budget[1]), noise_seed=seed, run_dir=run_dir,
                      data=dict(data), released_count=None if released is None else released.to_dict(),
                      released_stable=None if stable is None else copy.deepcopy(dict(stable)))
        set_key(result, "trainer.progress", False)
        return result

    def check_trial(self, data: Mapping[str, Any], loaded: LoadedData) -> None:
        """Raise every refusal a trial of config ``data`` (a trial config: its budget, the search's count) would
        raise before it spends anything: its run's own checks on public inputs and the released count (the
        evaluation's predicted noise, delta < 1/n, the batch size, whether one training step fits)."""
        from dporl.pipelines.train import training_plan
        from dporl.pipelines.train.planning import preflight

        config = self.config(data)
        budgets, _, plan = training_plan(config, loaded.dataset)
        preflight(config, loaded.dataset, loaded.experts, budgets, plan)

    def planner(self, data: Mapping[str, Any], dataset: Any) -> Callable[[float], TrialPrivacy]:
        """trial epsilon -> the events a trial of config ``data`` (a trial config: its count, its privacy keys)
        records at that budget, as its run plans them (``dporl.pipelines.train``)."""
        from dporl.algos.expert_sources import expert_source
        from dporl.eval.private_ope import dpsgd_mechanism, gaussian_noise_multiplier
        from dporl.pipelines.train import TRAIN_STAGE, training_noise, training_plan
        from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
        from dporl.privacy.relations import ADD_REMOVE

        base = self.config(data)
        self.check_base(base)
        _, train_data, plan = training_plan(base, dataset)
        cells = () if plan is None or plan.partition is None else tuple(plan.partition.names)
        units = ReleasedCount.from_dict(base.released_count, CountPlan(base.released_count["epsilon"], cells or None)
                                        ).units()
        held_out = plan is not None and plan.train_cells is not None
        private = expert_source(train_data, base.batch_size, base.dp.rows_per_unit, units,
                                "train" if held_out else None, base.algorithm.algorithm.batch_keys)
        source = base.method_spec.step_source(private, base.dp.p_dp)  # a mixture step for mixed
        if plan is not None and plan.estimator not in ("fqe", "none"):
            raise ValidationError("eval.offline.estimator", f"a search plans the DP-FQE evaluation of its trials "
                                  f"(estimator fqe), not {plan.estimator!r}")

        def at(trial_epsilon: float) -> TrialPrivacy:
            config = replace(base, epsilon=float(trial_epsilon))
            budgets, _, eval_plan = training_plan(config, dataset)
            stages = []
            if TRAIN_STAGE not in budgets:  # stable_only: noiseless training on the search's release
                return TrialPrivacy((), cells)
            eps, delta = budgets[TRAIN_STAGE]
            sigma = training_noise(config, budgets, None, source.step_event, eval_plan)
            event = source.step_event(sigma)
            steps = max_steps(event, eps, delta, mechanism=config.dp.accountant, limit=config.trainer.max_steps)
            stages.append(PlannedStage(TRAIN_STAGE, ((event, steps),), eval_plan.train_cells if eval_plan else None))
            if eval_plan is not None and eval_plan.estimator == "fqe":
                e_eps, e_delta = eval_plan.budget
                fqe = config.eval.offline.fqe
                eps_train = e_eps * fqe.train_fraction
                mechanism = dpsgd_mechanism(ADD_REMOVE)
                sigma_f = calibrate_noise_multiplier(eps_train, e_delta / 2, fqe.steps, mechanism=mechanism,
                                                     make_event=lambda s: PoissonGaussianEvent(s, fqe.sample_rate))
                fqe_event = PoissonGaussianEvent(sigma_f, fqe.sample_rate)
                fqe_steps = max_steps(fqe_event, eps_train, e_delta / 2, mechanism=mechanism, limit=fqe.steps)
                value = PoissonGaussianEvent(gaussian_noise_multiplier(e_eps - eps_train, e_delta / 2), 1.0)
                for cell in eval_plan.evaluation_cells():
                    stages.append(PlannedStage(f"{cell}/train", ((fqe_event, fqe_steps),), (cell,)))
                    stages.append(PlannedStage(f"{cell}/value", ((value, 1),), (cell,)))
            return TrialPrivacy(tuple(stages), cells)

        return at

    def score(self, summary: Mapping[str, Any], key: Optional[str]) -> tuple[str, float]:
        """(key, value): a trial's score from its released summary: ``key``, or its private evaluation's value (no
        simulator), or its mean return in the public simulator."""
        if key is None:
            evaluation = summary.get("evaluation") or {}
            key = "evaluation.value" if evaluation.get("mode") == "offline" else "return_mean_last_evals"
        try:
            value = get_key(summary, key)
        except KeyError:
            raise ValidationError("score.key", f"a trial's release/summary.json has no {key!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValidationError("score.key", f"{key!r} is not a number in a trial's summary: {value!r}")
        return key, float(value)


TRIAL_KINDS: dict[str, Callable[[], Any]] = {"train": TrainTrials}


def trial_kind(pipeline: Any):
    if pipeline not in TRIAL_KINDS:
        raise ValidationError("pipeline", f"a private search tunes {', '.join(sorted(TRIAL_KINDS))} runs, not "
                              f"{pipeline!r}")
    return TRIAL_KINDS[pipeline]()


__all__ = ["TrainTrials", "LoadedData", "PlannedStage", "TrialPrivacy", "trial_kind"]
