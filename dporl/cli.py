"""The ``dporl`` command (installed by ``pip install .``; also ``python -m dporl``).

    dporl train --config configs/X.yaml [--resume | --overwrite] [--json] [--print-config] [key=value ...]
    dporl tune --config configs/X.yaml --space S.yaml [--resume | --overwrite] [--json] [key=value | tune.key=value ...]
    dporl sweep --config configs/sweep_X.yaml [--from-runs RUNS_CSV ...] [key=value ...]
    dporl list                                  the pipelines, algorithms and methods dporl knows
    dporl evaluate --run RUN [--episodes 100] [--seed 12345] [--env ENV_ID] [--json]
    dporl evaluate --policy RUN/release/policy | --checkpoint RUN/curator/checkpoints/last.pt
    dporl audit (--all | --mechanism NAME | --config C | --neighbours C | --list) [--trials N] ...  (``python -m dporl.audit``)
    dporl data inspect FILE [--episode COL --unit COL --observations A,B|PREFIX --action COL --reward COL
                            --actions N|LABELS ...] [--json]
    dporl data example treatment_chain OUT.csv [--units N] [--episodes-per-unit K] [--seed S]
    dporl init table FILE.csv [--out CONFIG.yaml]

``train``: run the pipeline a YAML config names. Overrides use dotted keys (``epsilon=1 trainer.max_steps=500``);
values are parsed as YAML; unknown keys fail. The run directory must be new or empty: ``--resume`` continues the run
found there if its provenance (config and input hashes) equals this one's and names what differs otherwise;
``--overwrite`` replaces it after the new config and inputs were validated. stdout ends with the headline metrics
and the guarantee; the full config and summaries go to the run directory (``--json`` prints the whole public
summary instead). Share ``RUN/release/``; never share ``RUN/curator/``. ``--print-config`` prints the fully resolved
config (defaults filled in, overrides applied, validated) as YAML and exits without running. Every key is described in
docs/config.md (``python -m dporl.config_reference``).

``init table``: a starting "train" config for a CSV / Parquet table, written from its header alone (no row is read):
columns assigned to roles by name, every public fact the run needs (the action set, the value bounds, a unit's
clip) and the budget as ``TODO: ...`` placeholders the loader refuses, naming the key, until they are filled in.

``sweep``: a "train" config over budgets x methods x seeds (``dporl.pipelines.sweep``); ``--from-runs`` tabulates
earlier sweeps' runs instead of running.

``list``: every pipeline, every registered algorithm (``dporl.algos.registry``: its loss form, the batch keys it
reads, the policy it releases, its Python API config) and every method (``dporl.methods``).

``evaluate``: returns of a released policy in its public simulator, from ``RUN/release/`` alone (post-processing: no
privacy cost); ``--checkpoint`` rescores a curator checkpoint with its pipeline's hook. A run evaluated without a
simulator (``--run`` without ``--env``) shows the private offline value estimate and interval it released
(``RUN/release/summary.json``): nothing is recomputed and nothing is spent.

``data inspect``: what a dataset file holds (episodes, units, actions, observation shape, unit column). It describes
PRIVATE data: the output is curator-only information, never to be published. Without ``--actions`` it shows the
action values the rows logged, the one place dporl infers them: a private run declares its action set instead.

Every refusal (bad input, impossible budget) exits with status 2, names the field, and writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from dporl.utils.validation import ValidationError


# ---------------------------------------------------------------------------------------------------- train
def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML file naming a pipeline (see dporl list)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_const", const="resume", dest="mode",
                      help="continue the run in the run directory (same config and inputs only)")
    mode.add_argument("--overwrite", action="store_const", const="overwrite", dest="mode",
                      help="replace the run in the run directory (removed after the new config validated)")
    parser.add_argument("--json", action="store_true", help="print the whole public summary as JSON")
    parser.add_argument("--print-config", action="store_true",
                        help="print the fully resolved config (after overrides) as YAML and exit without running")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")


def train(args: argparse.Namespace) -> int:
    from dporl.pipelines import read_config, run_cli
    from dporl.utils.config import dump_config, from_dict

    if getattr(args, "print_config", False):
        try:
            pipeline, data = read_config(args.config, args.overrides)
            text = dump_config(from_dict(pipeline.config_cls, data))
        except ValidationError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(text, end="")
        return 0

    def work() -> dict:
        pipeline, data = read_config(args.config, args.overrides)
        return pipeline.run(from_dict(pipeline.config_cls, data), mode=args.mode or "new")

    return run_cli(work, as_json=args.json, resume_command=resume_command())


def resume_command(argv: Optional[list[str]] = None) -> str:
    """The command line that continues this run: the one that started it (``sys.orig_argv``: ``python -m dporl``,
    ``dporl`` or ``train.py``) with ``--overwrite`` / ``--resume`` replaced by one ``--resume``."""
    import shlex

    words = list(sys.orig_argv if argv is None else argv)
    if len(words) > 1 and Path(words[1]).name == "dporl":  # the installed console script
        words = ["dporl", *words[2:]]
    elif words and Path(words[0]).name.startswith("python"):
        words[0] = "python"
    kept = [w for w in words if w not in ("--overwrite", "--resume")]
    return shlex.join(kept + ["--resume"])


def train_main(argv: Optional[list[str]] = None, prog: str = "dporl train") -> int:
    """``dporl train`` (and ``train.py``)."""
    return _standalone(add_train_arguments, train, argv, prog)


def _standalone(add_arguments, command, argv: Optional[list[str]], prog: str) -> int:
    """One subcommand as its own program (``train.py``, ``evaluate.py``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return command(parser.parse_args(argv))


# ---------------------------------------------------------------------------------------------------- tune
def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)
    parser.add_argument("--space", required=True, help="YAML search space and search settings (dporl.tuning.config)")


def tune(args: argparse.Namespace) -> int:
    """A private hyperparameter search (``dporl.tuning``): one guarantee over every trial and the selection."""
    from dporl.pipelines import run_cli
    from dporl.tuning import tune as run_tune

    return run_cli(lambda: run_tune(args.config, args.space, mode=args.mode or "new", overrides=args.overrides),
                   as_json=args.json)


# ---------------------------------------------------------------------------------------------------- evaluate
def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a run directory (its release/policy is evaluated)")
    source.add_argument("--policy", help="a policy directory (e.g. RUN/release/policy)")
    source.add_argument("--checkpoint", help="a curator checkpoint, rescored by its pipeline's hook")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--env", default=None, help="environment id (default: the one the policy names)")
    parser.add_argument("--num-envs", type=int, default=10)
    parser.add_argument("--max-episode-steps", type=int, default=None)
    parser.add_argument("--out", default=None, help="directory for eval outputs")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")


def evaluate(args: argparse.Namespace) -> int:
    from dporl.pipelines import get_pipeline, run_cli

    def work() -> dict:
        if args.episodes < 1:
            raise ValidationError("episodes", f"must be >= 1, got {args.episodes}")
        out = Path(args.out) if args.out else None
        if args.checkpoint is not None:
            from dporl.train.checkpoint import load_checkpoint

            payload = load_checkpoint(args.checkpoint)
            pipeline = get_pipeline(payload["pipeline"])
            if pipeline.evaluate is None:
                raise ValidationError("checkpoint", f"pipeline {pipeline.name!r} has no checkpoint evaluator; use --run")
            run_dir = Path(args.checkpoint).resolve().parent.parent.parent  # RUN/curator/checkpoints/last.pt
            return pipeline.evaluate(payload, episodes=args.episodes, seed=args.seed, out_dir=out or run_dir)
        from dporl.eval.returns import evaluate_released_policy

        if args.run is not None and args.env is None:
            released = released_offline_evaluation(Path(args.run))
            if released is not None:
                return released
        policy_dir = Path(args.policy) if args.policy else Path(args.run) / "release" / "policy"
        return evaluate_released_policy(
            policy_dir, episodes=args.episodes, seed=args.seed, env_id=args.env, num_envs=args.num_envs,
            max_episode_steps=args.max_episode_steps, out=out, progress=not args.no_progress,
        )

    return run_cli(work, as_json=args.json)


def released_offline_evaluation(run: Path) -> Optional[dict]:
    """The offline evaluation a run without a simulator released (``RUN/release/summary.json``), as ``evaluate``
    shows it; None for a run evaluated in a simulator (or one whose summary records no evaluation: the simulator
    path then names what is missing). A run that released no evaluation is refused, naming how to evaluate it."""
    from dporl.utils.io import read_json

    path = run / "release" / "summary.json"
    if not path.is_file():
        if (run / "release").is_dir():
            raise ValidationError("run", f"{run} has no release/summary.json: the run did not finish (resume it)")
        return None
    summary = read_json(path, "run.summary")
    evaluation = summary.get("evaluation") if isinstance(summary, dict) else None
    if not isinstance(evaluation, dict) or evaluation.get("mode") == "simulator":
        return None
    if evaluation.get("mode") != "offline":
        raise ValidationError("run", f"{run} was trained without a simulator and released no offline evaluation "
                              "(eval.enabled: false or eval.offline.estimator: none): pass --env ENV_ID to evaluate "
                              "its policy in a simulator")

    def number(key: str) -> str:
        value = evaluation.get(key)
        return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "none"

    estimator = str(evaluation.get("estimator", "?")).upper()
    confidence = evaluation.get("confidence")
    level = f"{100 * confidence:g}% interval" if isinstance(confidence, (int, float)) else "interval"
    calibrated = evaluation.get("calibrated", True) is True
    return {
        "run": str(run),
        "source": "release/summary.json: the value the run released (nothing recomputed, no privacy cost)",
        "evaluation": evaluation,
        "privacy": summary.get("privacy"),
        "headline": {f"policy value (DP-{estimator}, {level}, released by the run)":
                     f"{number('value')} [{number('ci_low')}, {number('ci_high')}]"
                     + ("" if calibrated else " (interval NOT calibrated: see the evaluation's notes)")},
    }


def evaluate_main(argv: Optional[list[str]] = None, prog: str = "dporl evaluate") -> int:
    """``dporl evaluate`` (and ``evaluate.py``)."""
    return _standalone(add_evaluate_arguments, evaluate, argv, prog)


# ---------------------------------------------------------------------------------------------------- data
TABLE_FLAGS = ("episode", "unit", "observations", "action", "reward", "step", "terminated", "truncated",
               "next_observations", "propensity")


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="data_command", required=True)
    inspect = commands.add_parser(
        "inspect", help="summarise a dataset file (curator-only: it describes private data)",
        description="Summarise a dataset: a saved .npz, a CSV / Parquet table (give its column mapping) or a local "
                    "Minari dataset id (give --unit, the info key of the privacy unit). The output describes PRIVATE "
                    "data: it is curator-only information, never to be published.")
    inspect.add_argument("file", help="a .npz dataset, a .csv/.tsv/.parquet table, or a Minari dataset id")
    inspect.add_argument("--format", choices=["auto", "npz", "table", "minari"], default="auto")
    for flag in TABLE_FLAGS:
        inspect.add_argument(f"--{flag.replace('_', '-')}", dest=flag, default=None,
                             help=f"table: the {flag.replace('_', ' ')} column" +
                                  (" (a comma-separated list a,b,c, or a prefix of columns)" if "observations" in flag
                                   else "") +
                                  ("; minari: the info key of the unit" if flag == "unit" else ""))
    inspect.add_argument("--actions", default=None,
                         help="table: the declared action set, a count (e.g. 3) or comma-separated labels (e.g. "
                              "wait,treat), checked against the rows; default: the logged values (curator-only)")
    inspect.add_argument("--propensity-kind", choices=["prob", "log_prob"], default="prob")
    inspect.add_argument("--json", action="store_true")
    example = commands.add_parser(
        "example", help="write an example table with a known policy value (public synthetic data)",
        description="Write a logged-decision table of the treatment chain (dporl.eval.ope_coverage): clinicians "
                    "as units, one-hot states, treat / wait, logged propensities; every policy's value is exact.")
    example.add_argument("problem", choices=["treatment_chain"])
    example.add_argument("out", help="the CSV (or .parquet) file to write")
    example.add_argument("--units", type=int, default=4000)
    example.add_argument("--episodes-per-unit", type=int, default=4)
    example.add_argument("--seed", type=int, default=0)


def data(args: argparse.Namespace) -> int:
    from dporl.pipelines import run_cli

    if args.data_command == "example":
        return run_cli(lambda: write_example(args))
    if args.json:
        return run_cli(lambda: inspect_dataset(args), as_json=True)
    try:
        summary = inspect_dataset(args)
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(describe_dataset(summary))
    return 0


def _format_of(args: argparse.Namespace) -> str:
    if args.format != "auto":
        return args.format
    suffix = Path(args.file).suffix.lower()
    if suffix == ".npz":
        return "npz"
    if suffix in (".csv", ".tsv", ".txt", ".gz", ".parquet", ".pq"):
        return "table"
    return "minari"


def inspect_dataset(args: argparse.Namespace) -> dict:
    """A curator-only summary of a dataset file (counts of private rows: never publish it)."""
    import numpy as np

    from dporl.data.dataset import TrajectoryDataset
    from dporl.data.table import import_summary, logged_action_values, read_minari, read_table

    kind = _format_of(args)
    inferred = False
    if kind == "npz":
        dataset = TrajectoryDataset.load(args.file)
    elif kind == "table":
        mapping = {flag: getattr(args, flag) for flag in TABLE_FLAGS if getattr(args, flag) is not None}
        for flag in ("observations", "next_observations"):  # a comma-separated list of columns, or one / a prefix
            if flag in mapping and "," in mapping[flag]:
                mapping[flag] = [name.strip() for name in mapping[flag].split(",") if name.strip()]
        missing = [flag for flag in ("episode", "unit", "observations", "action", "reward") if flag not in mapping]
        if missing:
            raise ValidationError(f"--{missing[0]}", "a table needs its column mapping: --episode, --unit, "
                                  "--observations, --action, --reward (and optional --step, --terminated, "
                                  "--truncated, --next-observations, --propensity)")
        if args.actions is not None:
            actions, inferred = parse_actions(args.actions), False
        else:  # curator-only inference: what the rows logged (a private run must declare its set)
            actions, inferred = inferred_action_set(logged_action_values(args.file, mapping["action"])), True
        dataset = read_table(args.file, **mapping, actions=actions, propensity_kind=args.propensity_kind)
    else:
        if args.unit is None:
            raise ValidationError("--unit", "a Minari dataset needs the info key of its privacy unit")
        dataset = read_minari(args.file, unit=args.unit)
    meta = dataset.metadata
    per_unit = np.bincount(dataset.unit_ids, minlength=dataset.n_units)
    return {
        "file": str(args.file),
        "format": kind,
        "curator_only": True,
        "episodes": dataset.n_episodes,
        "transitions": dataset.n_transitions,
        "units": dataset.n_units,
        "unit_column": meta.unit_column or "expert_id (the logging expert)",
        "episodes_per_unit": {"min": int(per_unit.min()), "mean": float(per_unit.mean()), "max": int(per_unit.max())},
        "actions": meta.n_actions,
        "action_labels": None if meta.action_labels is None else list(meta.action_labels),
        "actions_inferred": inferred,
        "action_counts": dataset.summary()["action_counts"],
        "observation_shape": list(meta.obs_shape),
        "propensities": dataset.behavior_log_probs is not None,
        "env_id": meta.env_id,
        "import": import_summary(dataset),
    }


def parse_actions(text: str):
    """``--actions``: a count ("3") or comma-separated labels ("wait,treat"; integers where every label is one)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    labels = [label.strip() for label in text.split(",")]
    if all(label.lstrip("-").isdigit() for label in labels):
        return [int(label) for label in labels]
    return labels


def inferred_action_set(values: list):
    """The set ``dporl data inspect`` shows when none is declared (curator-only): the count max + 1 for
    non-negative integer actions (as a run declaring that count reads them), else the sorted logged labels."""
    if values and all(isinstance(v, bool) for v in values):
        return 2
    if values and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return max(values) + 1
    return [str(v) for v in values] if not all(isinstance(v, int) for v in values) else values


def describe_dataset(summary: dict) -> str:
    per_unit = summary["episodes_per_unit"]
    lines = [
        f"{summary['file']} ({summary['format']})",
        f"  episodes: {summary['episodes']}  transitions: {summary['transitions']}",
        f"  units: {summary['units']} (column {summary['unit_column']}); episodes per unit: min {per_unit['min']}, "
        f"mean {per_unit['mean']:.3g}, max {per_unit['max']}",
        f"  actions: {summary['actions']}"
        + (f" labelled {summary['action_labels']}" if summary.get("action_labels") else "")
        + f" (counts {summary['action_counts']})"
        + ("; INFERRED from the logged rows: a private run must declare its action set (columns.actions / "
           "read_table(actions=...)), never take it from here" if summary.get("actions_inferred") else ""),
        f"  observation shape: {tuple(summary['observation_shape'])}",
        f"  propensities logged: {'yes' if summary['propensities'] else 'no'}; env id: {summary['env_id']}",
    ]
    imported = summary.get("import")
    if imported:
        lines.append(f"  import: {imported['rows']} rows, {imported['dropped_truncated_steps']} truncated last steps "
                     f"dropped (no next state), {imported['terminal_placeholders']} terminal placeholders, "
                     f"{imported.get('dropped_out_of_set_episodes', 0)} episodes dropped (an action outside the "
                     "declared set)")
    lines.append("CURATOR-ONLY: these counts describe private data; they are not covered by any privacy guarantee. "
                 "Never publish them.")
    return "\n".join(lines)


def write_example(args: argparse.Namespace) -> dict:
    from dporl.pipelines.inputs import ExampleTable
    from dporl.utils.io import atomic_write

    example = ExampleTable(problem=args.problem, units=args.units, episodes_per_unit=args.episodes_per_unit,
                           seed=args.seed)
    frame = example.frame()
    out = Path(args.out)
    if out.suffix.lower() in (".parquet", ".pq"):
        atomic_write(out, lambda tmp: frame.to_parquet(tmp, index=False), suffix=".parquet")
    else:
        atomic_write(out, lambda tmp: frame.to_csv(tmp, index=False), suffix=".csv")
    return {"wrote": str(out), "problem": args.problem, "units": args.units,
            "episodes_per_unit": args.episodes_per_unit, "seed": args.seed,
            "columns": "episode, clinician (the unit), step, obs_0.., action, reward, terminated, truncated, "
                       "next_obs_0.., propensity",
            "actions": "2 (0 = wait, 1 = treat): declare it (columns.actions: 2, read_table(..., actions=2))"}


# ---------------------------------------------------------------------------------------------------- init
def add_init_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="init_command", required=True)
    table = commands.add_parser(
        "table", help="a starting train config for a CSV / Parquet table, from its header alone",
        description="Write a starting 'train' config for a table from its header alone (no row is read). Check the "
                    "column guesses and fill in every TODO (the public facts: action set, value bounds, unit clip; "
                    "and the budget): a run refuses a TODO, naming its key.")
    table.add_argument("file", help="a .csv / .tsv / .parquet table")
    table.add_argument("--out", default=None, help="the YAML file to write (default: stdout); never overwritten")


def init(args: argparse.Namespace) -> int:
    from dporl.pipelines.table_config import table_config
    from dporl.utils.io import atomic_write_text

    try:
        text = table_config(args.file)
        if args.out is not None:
            out = Path(args.out)
            if out.exists():
                raise ValidationError("--out", f"{out} exists: choose another file (a config is never overwritten)")
            atomic_write_text(out, text)
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        print(text, end="")
    else:
        print(f"wrote {args.out}: check the column guesses and fill in every TODO, then "
              f"dporl train --config {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------------- list
def listing() -> str:
    """What ``dporl list`` prints: the pipelines, the registered algorithms and the methods, each with one line."""
    from dporl.algos.registry import entries
    from dporl.methods.reward_level import METHODS as REWARD_LEVEL
    from dporl.methods.unit_level import METHODS as UNIT_LEVEL
    from dporl.pipelines import PIPELINES

    lines = ["pipelines (pipeline: NAME):"]
    lines += [f"  {name:12s} {summary}" for name, (_, summary) in sorted(PIPELINES.items())]
    lines.append("algorithms of the train pipeline (algorithm: NAME):")
    for entry in entries():
        d = entry.declaration
        lines.append(f"  {entry.name:12s} {entry.summary}")
        lines.append(f"  {'':12s} {entry.algorithm_cls.__name__}; loss: {d.loss_form.value}; reads "
                     f"{', '.join(d.batch_keys)}; releases {d.policy_kind}; Python API: dporl.{entry.api_name}"
                     f"(...).create(data) -> dporl.{entry.learner_name}")
    lines.append("methods of the train pipeline (method: NAME):")
    lines += [f"  {m.name:12s} {m.label}" for m in UNIT_LEVEL.values()]
    lines.append("methods of the fnq pipeline (methods: [NAME, ...]):")
    lines += [f"  {m.name:18s} {m.label}" for m in REWARD_LEVEL.values()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "audit":  # its own parser (python -m dporl.audit), every option passed through
        from dporl.audit.__main__ import main as audit_main

        return audit_main(argv[1:], prog="dporl audit")
    if argv and argv[0] == "sweep":  # its own parser (dporl.pipelines.sweep)
        from dporl.pipelines.sweep import main as sweep_main

        return sweep_main(argv[1:], prog="dporl sweep")
    parser = argparse.ArgumentParser(prog="dporl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(commands.add_parser("train", help="run a pipeline config (private training + evaluation)"))
    add_tune_arguments(commands.add_parser("tune", help="private hyperparameter search: the best of a random "
                                           "number of private runs, one guarantee"))
    commands.add_parser("sweep", help="a train config over budgets x methods x seeds (see dporl sweep --help)")
    commands.add_parser("list", help="the pipelines, algorithms and methods dporl knows")
    add_evaluate_arguments(commands.add_parser("evaluate", help="returns of a released policy in its simulator"))
    commands.add_parser("audit", help="audit the privacy claims empirically (see dporl audit --help)")
    add_data_arguments(commands.add_parser("data", help="inspect a dataset (curator-only) or write an example"))
    add_init_arguments(commands.add_parser("init", help="a starting config for a table, from its header alone"))
    args = parser.parse_args(argv)
    if args.command == "train":
        return train(args)
    if args.command == "tune":
        return tune(args)
    if args.command == "evaluate":
        return evaluate(args)
    if args.command == "list":
        print(listing())
        return 0
    if args.command == "init":
        return init(args)
    return data(args)


if __name__ == "__main__":
    sys.exit(main())
