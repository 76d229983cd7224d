"""The registry of released fields that are outputs of named accounted mechanisms (or functions of them).

A guarantee covers everything a run releases. Run a pipeline on D and on its neighbour D' with the same noise seed
(``dporl.audit.neighbour_runs``): every released field that differs (``dporl.audit.release_snapshot``) must be the
output of an accounted mechanism, or a deterministic function of such outputs and public inputs, and must be listed
here. A differing field no entry lists is unaccounted: the printed guarantee does not cover it.

``ENTRIES`` is the one table. Each ``Accounted`` names:

- ``pipelines``: patterns over "pipeline/method" keys (``train/mixed``, ``fnq/fnq``, ``ope/gpope``, and
  ``mechanism/<name>`` for mechanisms called as a library);
- ``files``: a pattern over the location (a released file's path under the run directory, a TensorBoard event
  file slot ``.../events[k]``, or ``stdout``);
- ``fields``: a pattern over the field path in that file (``line[i]`` for stdout); ``value``: a regular expression
  BOTH differing values must match (stdout: which lines); ``numbers_only``: the two values are strings equal once
  every number in them is masked (a printed guarantee may change its digits, never its words or flags);
- ``mechanism``: the accounted stage or mechanism the field is an output of; ``why``: one line of reasoning;
- ``needs``: conditions on the two releases themselves (both sides must meet them):
  ``"count"``: the unit count is accounted (``count_accounted``): the release's privacy report holds a stage named
  ``unit_count`` (or ``unit_count`` per cell: ``evaluate0/unit_count``; a private estimate of the number of units,
  charged to the budget) and no note assuming the number
  of units public, or the guarantee's relation is replace-one (the number of units is then public by definition).
  Fields computed from the number of units (sampling rates B / m, the noise calibrated for them, step counts,
  every epsilon digit, fold normalisers, and the weights and values those mechanisms release) are accounted only
  under this condition: computed from the exact private count they are not.
  ``"failed"``: either release reports a failed private estimate (a field ``...status`` equal to ``no_estimate``
  or ``diverged``: a released denominator <= 0, or a released divergence signal of DP-FQE); the estimate's flags
  (``calibrated``, ``status``) and the words of its printed lines are then functions of that release.
- ``stage``: for fields of a privacy report's ``stages[i]``, only the stage of that name.

Patterns: ``*`` matches any characters (``/``, ``.``, ``[`` included); nothing else is special.

Nothing else is listed: wall-clock times, file names with host names or process ids, counts of private rows,
action sets or reward ranges read from the data, flags computed from private data, refusals (``outcome``) and the
list of released files are never accounted outputs, except a refusal on the released count itself (a cell whose
released count is below one unit): its words are fixed, its numbers functions of the released count. Such a refusal
is a gate (``gate``): where one side refuses on it and the other runs (the same noise gives the two sides released
counts one apart), every difference of the pair is downstream of the released count; pairs where both sides run
check the running side's fields one by one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence

from dporl.audit.release_snapshot import Difference, Snapshot

COUNT = "count"
FAILED = "failed"
COUNT_STAGE = "unit_count"
FAILED_STATUSES = ("no_estimate", "diverged")


@dataclass(frozen=True)
class Accounted:
    pipelines: tuple[str, ...]
    files: str
    fields: str
    mechanism: str
    why: str
    needs: tuple[str, ...] = ()
    value: Optional[str] = None  # a regex both differing values (strings) must match
    numbers_only: bool = False  # both values are strings that differ only in their numbers
    stage: Optional[str] = None  # fields under stages[i] of a privacy report: the stage's name
    gate: bool = False  # an outcome decided by a released value: one side ending in it explains every difference

    def applies_to(self, keys: Sequence[str]) -> bool:
        """Whether this entry speaks for a run of ``keys`` (one of its pipeline patterns matches one key)."""
        return any(matches(pattern, key) for pattern in self.pipelines for key in keys)

    def to_dict(self) -> dict[str, Any]:
        return {"pipelines": list(self.pipelines), "files": self.files, "fields": self.fields,
                "mechanism": self.mechanism, "why": self.why, "needs": list(self.needs),
                **({"value": self.value} if self.value else {}), **({"numbers_only": True} if self.numbers_only else {}),
                **({"stage": self.stage} if self.stage else {}), **({"gate": True} if self.gate else {})}


# Pipeline keys ("pipeline/method"; the offline evaluation adds "offline/<estimator>").
DPSGD = ("train/dp_sgd", "train/mixed")  # DP-SGD over units at rate B / m (Algorithms 3-4)
RELEASE = ("train/stable_only", "train/mixed")  # the stable-prefix release (Algorithms 1-2)
TRAIN = ("train/*",)
COUNTED = (*DPSGD, "ope/gpope")  # Poisson sampling over units: rates, noise and steps depend on m
FNQ = ("fnq/*",)
RATIO = ("offline/wis", "offline/pdis")  # self-normalised: noisy numerator over noisy denominator, no count
FOLDS = ("offline/fqe", "offline/dr")  # DP-FQE normalises its DP-SGD by sample_rate x the fold's unit count
OFFLINE = (*RATIO, *FOLDS)
RELEASED_JSON = "*release/*.json"  # privacy_report.json, summary.json, train_summary.json, policy/policy.json
EVENTS = "*release/tensorboard/events*"
RESULT = "result"  # a mechanism called as a library: its returned release

_WEIGHTS_DPSGD = "policy weights: DP-SGD / Algorithm 3's mixture steps (stage 'train')"
_WEIGHTS_STABLE = "policy weights: noiseless training on D_stable (post-processing of stage 'release')"
_RELEASE = "stable-prefix release (stage 'release')"
_PRIVACY = "the privacy accounting of stages whose sampling rate is B / m"
_COUNT_WHY = ("computed from the number of units m: accounted only when m is a released private estimate (stage "
              "'unit_count') or public by the relation (replace-one)")
_SIM = "returns of the released policy in the public simulator (post-processing of the weights)"
_VALUE = "the private offline evaluation (DP importance sampling / DP-FQE / DP-DR)"
_COUNT = "private unit count (stage 'unit_count')"


def _offline(keys: tuple[str, ...], needs: tuple[str, ...]) -> list[Accounted]:
    A = Accounted
    why = _COUNT_WHY if needs else "noisy sums released by the Gaussian mechanism and their ratio"
    out = []
    for files, prefix in ((RELEASED_JSON, "*evaluation."), (RESULT, "")):
        out += [A(keys, files, f"{prefix}{name}", _VALUE, why, needs) for name in ("value", "ci_low", "ci_high")]
        out.append(A(keys, files, f"{prefix}fold_values*", _VALUE, "each fold's estimate: " + why, needs))
        out += [A(keys, files, f"{prefix}notes{{{start}*", _VALUE, "a note on the noisy release (a noisy denominator "
                  "too small or <= 0, a failed estimate): a function of the release", needs)
                for start in ("noisy denominator", "noisy within-sample variance", "a fold's noisy denominator",
                              "no estimate")]
        out += [A(keys, files, f"{prefix}{name}", _VALUE, "a failed estimate is never calibrated: a function of the "
                  "released denominator or divergence signal", (*needs, FAILED)) for name in ("calibrated", "status")]
    out += [
        A(keys, "*release/summary.json", "headline.policy value*", _VALUE, "the headline: " + why, needs,
          numbers_only=True),
        A(keys, EVENTS, "scalar offline/*", _VALUE, "the same, in TensorBoard", needs),
        A(keys, "stdout", "*", _VALUE, "the value and interval, printed", needs,
          value=r"^(offline evaluation: \w+: value |policy value \(DP-\w+, )", numbers_only=True),
        A(keys, "*release/summary.json", "headline.policy value*", _VALUE, "the headline of a failed estimate",
          (*needs, FAILED), value=r"\[.*\]"),
        A(keys, "stdout", "*", _VALUE, "the printed value of a failed estimate", (*needs, FAILED),
          value=r"^(offline evaluation: \w+: value .*|policy value \(DP-\w+, .*)$"),
    ]
    return out


def _entries() -> tuple[Accounted, ...]:
    A = Accounted
    return (
        # ---- policy weights and their files
        A(DPSGD, "*release/policy/weights.pt", "*", _WEIGHTS_DPSGD,
          "noisy clipped per-unit gradients; the rate B / m and the expected batch come from m", (COUNT,)),
        A(DPSGD, "*release/policy/policy.torchscript.pt", "*", _WEIGHTS_DPSGD, "the same weights, scripted", (COUNT,)),
        A(("train/stable_only",), "*release/policy/weights.pt", "*", _WEIGHTS_STABLE,
          "training without noise on D_stable only (it never reads the logged data)"),
        A(("train/stable_only",), "*release/policy/policy.torchscript.pt", "*", _WEIGHTS_STABLE,
          "the same weights, scripted"),
        A(TRAIN, "*release/policy/policy.json", "sha256.*", "policy weights (as above)",
          "sha256 of the weight files: a function of the weights and of a random temporary archive name"),
        # ---- the stable-prefix release
        A(RELEASE, "*release/d_stable.npz", "*", _RELEASE,
          "the released prefixes of fresh rollouts that passed the sparse-vector test"),
        *[A(RELEASE, "*release/*.json", pattern, _RELEASE, "the size of D_stable: a function of the release")
          for pattern in ("stable_transitions", "released_prefixes", "release.stable_transitions",
                          "release.released_prefixes")],
        A(RELEASE, "stdout", "*", _RELEASE, "its size, printed",
          value=r"^(stable-prefix release \(|stable_transitions: )", numbers_only=True),
        # ---- returns in the public simulator (post-processing of released weights)
        A(TRAIN, RELEASED_JSON, "*eval/*", _SIM, "the greedy policy's returns in the public simulator"),
        A(TRAIN, "*release/summary.json", "return_mean_last_evals", _SIM, "mean of the last evaluations"),
        A(TRAIN, "*release/summary.json", "headline.return in the simulator*", _SIM, "the headline of the same"),
        A(TRAIN, EVENTS, "scalar eval/*", _SIM, "the same, in TensorBoard"),
        A(TRAIN, "stdout", "*", _SIM, "the headline line",
          value=r"^(return in the simulator \(|return_mean_last_evals: )", numbers_only=True),
        A(TRAIN, "*release/evaluations/*", "*", _SIM, "evaluate.py's public-simulator evaluations"),
        # ---- the private offline evaluation
        *_offline(RATIO, ()),
        *_offline(FOLDS, (COUNT,)),
        # ---- the private unit count and everything derived from it
        A(TRAIN + ("ope/*",), RELEASED_JSON, "*unit_count*", _COUNT, "the released estimate of the number of units"),
        A(TRAIN + ("ope/*",), RELEASED_JSON, "*stages[*]*", _COUNT, "the count stage's record: its released estimate",
          stage=COUNT_STAGE),
        A(TRAIN + ("ope/*",), "stdout", "*", _COUNT, "the released estimate, printed",
          value=r"(?i)(unit count|unit_count|count of the units)", numbers_only=True),
        A(TRAIN, "outcome", "status", _COUNT, "a refusal of a cell whose released count is below one unit: its "
          "numbers are the released estimate and public constants; a gate: where one side refuses so and the other "
          "runs, the run's every difference is downstream of the released count",
          value=r"^(exit 2: )?error: (ValidationError: )?eval\.offline\.holdout: cell '[^']+' holds no unit by the "
                r"released count", numbers_only=True, gate=True),
        *[A(COUNTED, RELEASED_JSON, pattern, _PRIVACY, _COUNT_WHY, (COUNT,)) for pattern in (
            "*epsilon*", "*privacy/stage/*", "*sample_rate", "*noise_multiplier", "*basic_composition*",
            "*joint_pld*", "*events[*][1]", "steps", "budget_steps", "eval_history[*][0]",
        )],
        A(COUNTED, RELEASED_JSON, "*text", _PRIVACY, "the ledger's text: " + _COUNT_WHY, (COUNT,),
          numbers_only=True),
        A(COUNTED, EVENTS, "scalar privacy/*", _PRIVACY, _COUNT_WHY, (COUNT,)),
        A(COUNTED, EVENTS, "text privacy/*", _PRIVACY, "the plan and report texts: " + _COUNT_WHY, (COUNT,),
          numbers_only=True),
        A(COUNTED, EVENTS, "scalar train/lr @ *", _PRIVACY,
          "the public learning-rate schedule, logged at steps whose number is " + _COUNT_WHY, (COUNT,)),
        A(("train/*", "ope/gpope", "fnq/*"), EVENTS, "records", "the scalars logged (all listed)",
          "which (tag, step) records exist: non-finite released values are skipped; step counts are listed"),
        A(COUNTED, "stdout", "*", _PRIVACY, "the run's summary scalars: " + _COUNT_WHY, (COUNT,),
          value=r"^(noise_multiplier|steps): ", numbers_only=True),
        A(COUNTED, "stdout", "*", _PRIVACY, "the ledger's printout: " + _COUNT_WHY, (COUNT,),
          value=r"^(stage '[^']+': eps=|basic composition: eps=|joint PLD: eps=|cell '[^']+' \(stages |GUARANTEE: \(|"
                r"the paper's figure, NOT a guarantee: )", numbers_only=True),
        # ---- reward-level private Q-learning (the number of rewards is public: neighbours change values only)
        A(FNQ, "*release/released.pt", "*", "the released Q-function: Gaussian updates (fnq), DP-SGD (dp_sgd) or "
          "training on Gaussian-perturbed rewards (input_perturbation)",
          "the noisy updates / rewards and the public GP paths"),
        # ---- trajectory-level policy evaluation as a library (DP-LSW / DP-LSL release theta only)
        A(("ope/dp_lsw", "ope/dp_lsl"), RESULT, "theta*",
          "smooth-sensitivity Gaussian output perturbation (Balle et al. 2016)", "the released value parameters"),
    )


ENTRIES: tuple[Accounted, ...] = _entries()


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan")


@lru_cache(maxsize=512)
def _pattern(glob: str) -> re.Pattern:
    return re.compile("^" + ".*".join(re.escape(part) for part in glob.split("*")) + "$", re.S)


def matches(glob: str, text: str) -> bool:
    return bool(_pattern(glob).match(text))


def count_accounted(snap: Snapshot) -> bool:
    """Whether a release accounts for its number of units (module docstring, condition ``"count"``)."""
    reports = [fields for location, fields in snap.items() if location.endswith("privacy_report.json")]
    if not reports:
        return False
    for fields in reports:
        relation = str(fields.get("guarantee.relation", ""))
        if relation.startswith("replace"):
            continue
        stages = [v for k, v in fields.items() if re.fullmatch(r"stages\[\d+\]\.name", k)]
        notes = [k[len("notes{"):-1] for k in fields if k.startswith("notes{") and k.endswith("}")]
        assumed = any("number of units" in note and "public" in note for note in notes)
        if not any(is_count_stage(name) for name in stages) or assumed:
            return False
    return True


def is_count_stage(name: Any) -> bool:
    """A ledger stage of the private unit count: named ``unit_count``, or ``unit_count`` per cell (``x/unit_count``,
    ``unit_count/x``)."""
    return isinstance(name, str) and COUNT_STAGE in name.split("/")


def failed_estimate(snap: Snapshot) -> bool:
    """Whether a release reports a failed private estimate (module docstring, condition ``"failed"``)."""
    return any(str(key).split(".")[-1] == "status" and value in FAILED_STATUSES
               for fields in snap.values() for key, value in fields.items())


def conditions(snap_d: Snapshot, snap_dp: Snapshot) -> dict[str, bool]:
    """The ``needs`` conditions: ``count`` true only if both releases meet it, ``failed`` if either does."""
    return {COUNT: count_accounted(snap_d) and count_accounted(snap_dp),
            FAILED: failed_estimate(snap_d) or failed_estimate(snap_dp)}


def _stage_name(snap: Snapshot, location: str, field: str) -> Optional[str]:
    found = re.match(r"^(.*?stages\[\d+\])\.", field)
    if found is None:
        return None
    return snap.get(location, {}).get(f"{found.group(1)}.name")


def entry_for(difference: Difference, keys: Sequence[str], met: dict[str, bool], snap_d: Snapshot,
              snap_dp: Snapshot, entries: Iterable[Accounted] = ENTRIES) -> Optional[Accounted]:
    """The first entry that accounts for ``difference`` in a run of ``keys`` (None: unaccounted)."""
    for entry in entries:
        if not entry.applies_to(keys):
            continue
        if not matches(entry.files, difference.location):
            continue
        if not all(met.get(need, False) for need in entry.needs):
            continue
        if not matches(entry.fields, difference.field):
            continue
        values = (difference.value_d, difference.value_dp)
        if entry.value is not None and not all(isinstance(v, str) and re.search(entry.value, v) for v in values):
            continue
        if entry.numbers_only and not (all(isinstance(v, str) for v in values)
                                       and _NUMBER.sub("#", values[0]) == _NUMBER.sub("#", values[1])):
            continue
        if entry.stage is not None:
            names = [_stage_name(snap, difference.location, difference.field) for snap in (snap_d, snap_dp)]
            if not all(is_count_stage(name) if entry.stage == COUNT_STAGE else name == entry.stage for name in names):
                continue
        return entry
    return None


def gate_for(keys: Sequence[str], snap_d: Snapshot, snap_dp: Snapshot,
             entries: Iterable[Accounted] = ENTRIES) -> Optional[Accounted]:
    """The gate entry (``Accounted.gate``) when exactly one side's outcome is that gate's refusal and the other side
    ran: the refusal is a function of a released value (e.g. a cell's released count below one), so whether a run
    stops there, and everything the running side releases beyond what the stopping side does, is downstream of
    that released value and of the running side's own accounted mechanisms (whose fields a pair where both sides
    run checks one by one). None otherwise."""
    statuses = [str(snap.get("outcome", {}).get("status")) for snap in (snap_d, snap_dp)]
    if statuses.count("ok") != 1:
        return None
    refused = statuses[0] if statuses[1] == "ok" else statuses[1]
    for entry in entries:
        if entry.gate and entry.value is not None and re.search(entry.value, refused) and entry.applies_to(keys):
            return entry
    return None


@dataclass
class Classified:
    """The differences of one neighbour pair, each with the entry that accounts for it (None: unaccounted)."""

    keys: tuple[str, ...]
    accounted: list[tuple[Difference, Accounted]]
    unaccounted: list[Difference]
    conditions: dict[str, bool]

    @property
    def clean(self) -> bool:
        return not self.unaccounted

    def describe(self, limit: int = 40, width: int = 60) -> str:
        lines = [f"{len(self.unaccounted)} unaccounted difference(s) for {', '.join(self.keys)} "
                 f"(conditions: {self.conditions}); {len(self.accounted)} accounted"]
        lines += [f"  UNACCOUNTED {d.describe(width)}" for d in self.unaccounted[:limit]]
        if len(self.unaccounted) > limit:
            lines.append(f"  ... and {len(self.unaccounted) - limit} more")
        return "\n".join(lines)


def classify(differences: Sequence[Difference], keys: Sequence[str], snap_d: Snapshot, snap_dp: Snapshot,
             entries: Iterable[Accounted] = ENTRIES, assume: Optional[dict[str, bool]] = None) -> Classified:
    """Split ``differences`` into accounted (with their entries) and unaccounted, for a run of ``keys``.
    ``assume``: conditions to take as given instead of reading them from the releases (what-if analyses only)."""
    entries = tuple(entries)
    met = {**conditions(snap_d, snap_dp), **(assume or {})}
    gate = gate_for(keys, snap_d, snap_dp, entries)
    if gate is not None:  # one side stopped on a released value, the other ran: all downstream of that value
        return Classified(tuple(keys), [(difference, gate) for difference in differences], [], met)
    accounted, unaccounted = [], []
    for difference in differences:
        entry = entry_for(difference, keys, met, snap_d, snap_dp, entries)
        if entry is None:
            unaccounted.append(difference)
        else:
            accounted.append((difference, entry))
    return Classified(tuple(keys), accounted, unaccounted, met)


def registry_table(entries: Iterable[Accounted] = ENTRIES) -> str:
    """The registry as a Markdown table (for review and the docs)."""
    rows = ["| pipelines | file | field | mechanism | needs | why |", "|---|---|---|---|---|---|"]
    for e in entries:
        field = (e.fields + (f" (stage {e.stage})" if e.stage else "") + (f", value ~ /{e.value}/" if e.value else "")
                 + (", numbers only" if e.numbers_only else ""))
        rows.append(f"| {', '.join(e.pipelines)} | `{e.files}` | `{field}` | {e.mechanism} | "
                    f"{', '.join(e.needs) or '-'} | {e.why} |")
    return "\n".join(rows)
