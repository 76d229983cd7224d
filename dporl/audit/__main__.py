"""Audit dporl's privacy claims empirically.

    python -m dporl.audit --mechanism dpsgd_step --trials 20000 [--power] [noise_multiplier=2 sample_rate=0.1]
    python -m dporl.audit --config configs/expert_cql_cartpole.yaml --trials 20000 [--target 0] [--out a.json] [key=value]
    python -m dporl.audit --all --trials 20000 [--power]
    python -m dporl.audit --neighbours configs/expert_cql_quickstart.yaml [--unit 0] [--trials 20] [--power] [key=value]
    python -m dporl.audit --list | --accounted
    python -m dporl.audit --sigkill 30 [--seed 0] [--out kills.json]

--sigkill N audits robustness instead of privacy: it kills small training runs N times with SIGKILL at random
points (the release, training steps, checkpoint and journal writes), resumes them, and checks that no run ever
under-counts its guarantee or loses a paid step (dporl.audit.crash_resume); exit status 1 if one did.

With --mechanism, ``key=value`` sets the audit's settings; with --config / --neighbours, it overrides the config.
Every result prints eps_lb (a lower bound holding with the stated confidence) beside the claimed epsilon;
--out writes them all as one JSON file (atomically). The exit status is 1 if any claim is violated.

--neighbours runs the config's pipeline end to end on a FIXED pair: D (the config's data) and D' = D minus unit
``--unit`` with all its data (``--relation replace``: its data replaced by unit ``--donor``'s; ``reward``: fnq's
rewards changed by ``--change``), each in its own directory under ``--work`` (default: a temporary directory). Every
released field that differs at a fixed noise seed and is not an output of an accounted mechanism
(``--accounted`` lists the registry) is a distinguisher: eps_lb = inf. The accounted scalar fields are then scored
over ``--trials`` runs per side with fresh noise seeds (default 20: each trial is a whole run). --power adds the
exact number of units to what the run prints: the audit must name it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dporl.utils.config import apply_overrides, load_yaml, parse_override
from dporl.utils.io import atomic_write_json
from dporl.utils.validation import ValidationError


def _settings(overrides: list[str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for text in overrides:
        keys, value = parse_override(text)
        if len(keys) != 1:
            raise ValidationError(text, "audit settings are flat: use name=value")
        settings[keys[0]] = value
    return settings


def main(argv: list[str] | None = None, prog: str = "python -m dporl.audit") -> int:
    from dporl.audit.config_audit import audits_for_config
    from dporl.audit.experiment import run_audit
    from dporl.audit.registry import AUDITS, POWER_SETTINGS, build_audit

    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--mechanism", choices=sorted(AUDITS), help="a built-in audit")
    what.add_argument("--config", help="a pipeline YAML (train, ope): audit what it would release")
    what.add_argument("--all", action="store_true", help="every built-in audit at its default settings")
    what.add_argument("--neighbours", metavar="CONFIG",
                      help="a pipeline YAML: run it on D and D minus one unit, score everything it releases")
    what.add_argument("--list", action="store_true", help="list the built-in audits and their power settings")
    what.add_argument("--accounted", action="store_true",
                      help="print the registry of released fields that accounted mechanisms output")
    what.add_argument("--sigkill", type=int, metavar="N",
                      help="robustness: SIGKILL small runs N times at random points, resume, check the accounting")
    parser.add_argument("--trials", type=int, default=None,
                        help="trials per neighbour (default 20000; --neighbours: 20 whole runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--power", action="store_true", help="break the mechanism on purpose: the audit must object")
    parser.add_argument("--n-experts", type=int, default=None, help="--config: experts m, if not read from the data")
    parser.add_argument("--p-min", type=float, default=None, help="--config: p_min, if not read from the data")
    parser.add_argument("--target", type=int, default=0,
                        help="--config: the expert the stable-prefix audit removes from the config's data (D' = D minus it)")
    parser.add_argument("--relation", choices=("remove", "replace", "reward"), default="remove",
                        help="--neighbours: how D' differs from D (default: one unit removed)")
    parser.add_argument("--unit", type=int, default=0, help="--neighbours: the unit (index) removed or replaced")
    parser.add_argument("--unit-key", default=None, help="--neighbours, tables: the unit column's value instead")
    parser.add_argument("--donor", type=int, default=1, help="--neighbours --relation replace: the donor unit")
    parser.add_argument("--change", type=float, default=1.0, help="--neighbours --relation reward: the change")
    parser.add_argument("--via", choices=("process", "cli"), default="process",
                        help="--neighbours: run the pipeline in this process or as `dporl train` in a subprocess")
    parser.add_argument("--work", default=None, help="--neighbours: directory for the inputs and runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--work-dir", default=None, help="--sigkill: keep the killed runs here (default: a temporary "
                        "directory, removed afterwards)")
    parser.add_argument("overrides", nargs="*", help="key=value")
    args = parser.parse_args(argv)

    if args.sigkill is not None:
        from dporl.audit.crash_resume import audit as crash_audit, describe

        if args.sigkill < 1:
            print("error: --sigkill: must be >= 1", file=sys.stderr)
            return 2
        result = crash_audit(args.sigkill, seed=args.seed, work_dir=args.work_dir, progress=not args.no_progress)
        print(describe(result))
        if args.out:
            atomic_write_json(args.out, result)
            print(f"wrote {args.out}")
        return 0 if result["passed"] else 1
    if args.list:
        for name in sorted(AUDITS):
            print(f"{name:22s} power: {POWER_SETTINGS[name]}")
        print(f"{'--neighbours CONFIG':22s} power: the run also prints its exact number of units")
        return 0
    if args.accounted:
        from dporl.audit.accounted import registry_table

        print(registry_table())
        return 0
    if args.neighbours:
        return _neighbours(args)
    args.trials = 20_000 if args.trials is None else args.trials
    try:
        if args.config:
            if args.power:
                raise ValidationError("--power", "applies to built-in audits only")
            data = apply_overrides(load_yaml(args.config), args.overrides)
            experiments = audits_for_config(data, n_experts=args.n_experts, p_min=args.p_min, target=args.target)
        elif args.all:
            experiments = [build_audit(name, power=args.power) for name in sorted(AUDITS)]
        else:
            experiments = [build_audit(args.mechanism, _settings(args.overrides), power=args.power)]
        results = [
            run_audit(e, args.trials, seed=args.seed, confidence=args.confidence, progress=not args.no_progress)
            for e in experiments
        ]
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for result in results:
        print(result.describe())
    if args.out:
        atomic_write_json(args.out, {"power_variant": args.power, "results": [r.to_dict() for r in results]})
        print(f"wrote {args.out}")
    return 1 if any(r.violated for r in results) else 0


def _neighbours(args: argparse.Namespace) -> int:
    """--neighbours: the end-to-end audit of a config on a fixed neighbouring pair."""
    import tempfile
    from pathlib import Path

    from dporl.audit.neighbour_audit import audit_pair
    from dporl.audit.neighbour_runs import NeighbourPair

    try:
        config = apply_overrides(load_yaml(args.neighbours), args.overrides)
        pair = NeighbourPair(config, relation=args.relation, unit=args.unit, unit_key=args.unit_key,
                             donor=args.donor, change=args.change, via=args.via)
        trials = 20 if args.trials is None else args.trials
        with tempfile.TemporaryDirectory(prefix="dporl_neighbours_") as tmp:
            work = Path(args.work) if args.work else Path(tmp)
            result = audit_pair(pair, work, trials=trials, seed=args.seed, confidence=args.confidence,
                                leak=args.power, name=f"neighbours {Path(args.neighbours).name}",
                                progress=not args.no_progress)
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.describe())
    if args.out:
        atomic_write_json(args.out, {"power_variant": args.power, "results": [result.to_dict()]})
        print(f"wrote {args.out}")
    return 1 if result.violated else 0


if __name__ == "__main__":
    sys.exit(main())
