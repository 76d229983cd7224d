"""Every shipped config in ``configs/`` runs end to end at a tiny scale through the command a user types.

One parametrized test over ``configs/*.yaml``: a config with a ``pipeline:`` key runs as ``dporl train --config PATH
key=value...``; a search-space file (no ``pipeline:`` key) runs as ``dporl tune --config BASE --space PATH``, BASE
being the config its header's command names. Only the scale is overridden (experts, steps, episodes, trajectories,
network widths, output directories); the method, the budget, the relation, the environment and every declared public
fact are each config's own. A config that reads a dataset (``data.path``) is given one made by the repository's own
generators. A private run must print one guarantee within the config's budget and leave its release; a non-private
one its output file. A config with no tiny-scale recipe below fails, naming itself.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

from dporl.cli import main
from dporl.utils.config import apply_overrides, load_yaml
from test_expert_cql import log_lqr_experts

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
torch.set_num_threads(1)

GUARANTEE = re.compile(r"^GUARANTEE: \(([0-9.e+-]+), ([0-9.e+-]+)\)-DP", re.MULTILINE)

# ---------------------------------------------------------------------------------------------- recipes per kind
DATASET = ["experts.n_settings=2", "experts.eval_episodes=1", "experts.max_episode_steps=12",
           "trajectories_per_expert=2", "max_episode_steps=10", "progress=false"]
PPO_DATASET = {  # one PPO update per candidate, the config's own networks
    "CartPole-v1": ["experts.ppo.total_timesteps=512"],
    "Acrobot-v1": ["experts.ppo.total_timesteps=512"],
    "dporl/HIVTreatment-v0": ["experts.ppo.total_timesteps=20", "experts.ppo.n_envs=2", "experts.ppo.n_steps=10",
                              "experts.batch_experts=3"],
    "LunarLander-v3": ["experts.ppo.total_timesteps=64", "experts.ppo.n_steps=8", "experts.ray.enabled=false"],
}
TRAIN = ["noise_seed=0", "release.trajectories=2", "algorithm.hidden_sizes=[16]", "trainer.max_steps=6",
         "trainer.eval_every=3", "trainer.checkpoint_every=3", "trainer.log_every=3", "trainer.progress=false",
         "eval.episodes=1", "eval.num_envs=1", "eval.max_episode_steps=10", "eval.last_evals=1"]
GENERATE = ["data.generate.experts.max_episode_steps=10", "data.generate.max_episode_steps=10",
            "data.generate.trajectories_per_expert=1", "data.generate.progress=false"]
# Paper-scale generation (PPO candidates on Ray): one tiny PPO update per candidate, locally, the config's own grid
# and candidate selection (enough experts for the stable-prefix release to pass its m p_min check).
FULL = ["data.generate.experts.ray.enabled=false", "data.generate.experts.ppo.actor_hidden_sizes=[8]",
        "data.generate.experts.ppo.critic_hidden_sizes=[8]", "data.generate.experts.ppo.n_envs=1",
        "data.generate.experts.ppo.n_steps=4", "data.generate.experts.ppo.total_timesteps=4",
        "data.generate.experts.eval_episodes=1"]
TABLE = ["data.example.units=1500", "data.example.episodes_per_unit=2", "batch_size=32", "count_fraction=0.1",
         "algorithm.hidden_sizes=[16]", "trainer.max_steps=20", "trainer.eval_every=20", "trainer.log_every=20",
         "trainer.checkpoint_every=20", "trainer.progress=false", "eval.offline.folds=2", "eval.offline.fqe.steps=20",
         "dp.accountant=rdp", "noise_seed=3",
         "eval.offline.tolerance=1e6"]  # 1500 clinicians: the pre-spend noise check would refuse the evaluation
FNQ = ["samples=128", "batch_size=32", "seeds=[0]", "eval_episodes=2", "evaluations=1", "progress=false"]
OPE = ["trials=1", "m_values=[20]", "noise_seed=5", "progress=false", "gpope.epochs_grid=[1.0]",
       "gpope.step_size_grid=[0.05]", "gpope.step_size_multipliers=[1.0]", "gpope.clip_quantile_grid=[0.5]",
       "output_perturbation.lsl_lambda_grid=[10.0]"]
SWEEP = ["seeds=[0]", "progress=false"]
TUNE = ["tune.trials.mean=2", "tune.progress=false", "tune.noise_seed=11"]

# Per config: extra overrides (after its kind's), and the tiny dataset it reads, if any ("cartpole": 600 LQR
# experts; "acrobot": 1000 analytic energy-pumping experts, both logged by the repository's own generators).
EXTRA: dict[str, list[str]] = {
    "dataset_hiv_public_tune": [],
    "dataset_lunarlander_analytic": ["experts.env_workers=1"],
    "expert_cql_lunarlander": ["data.generate.experts.ppo.total_timesteps=8", "data.generate.experts.ppo.n_envs=1",
                               "data.generate.experts.ppo.n_steps=8"],
    "expert_cql_lunarlander_full": ["data.generate.experts.n_settings=400"],  # 1200 experts (Box2D steps in Python)
    "expert_cql_hiv_full": ["data.generate.experts.n_settings=700"],  # 2100 experts (HIV's fixed start needs ~2000)
    "fnq_cartpole": ["epsilons=[100]", "methods=[non_private,fnq]", "replay_capacity=256"],
    "fnq_line_compare": ["epsilons=[100]", "methods=[non_private,fnq]"],
    "fnq_line_paper": ["epsilons=[0.9]", "methods=[non_private,fnq_paper,fnq]", "reset_factors=[4]"],
    "fnq_line_sweep": ["sigmas=[0.0,1.0]", "reset_factors=[1,4]"],
    "fnq_line_sweep_dqn": ["sigmas=[0.0,1.0]", "reset_factors=[1,4]", "replay_capacity=256"],
    "ope_chain": ["chain.n_states=6"], "ope_chain_paper_scale": ["chain.n_states=6"],
    "ope_chain_tiny": ["chain.n_states=6"],
    "ope_hiv": ["hiv.horizon=5", "hiv.fqi_patients=4", "hiv.fqi_iterations=2", "hiv.heldout_trajectories=4"],
    "ope_mountain_car": ["mountain_car.q_learning_episodes=2", "mountain_car.heldout_trajectories=4",
                         "mountain_car.fourier_order=1"],
}
DATA = {"bc_cartpole_ppo": "cartpole", "expert_cql_cartpole_ppo": "cartpole", "expert_cql_acrobot_ppo": "acrobot",
        "expert_cql_lunarlander_analytic": "lunarlander"}


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory) -> Path:
    """600 LQR CartPole experts, one logged episode each (tests/test_expert_cql.py's pool)."""
    return log_lqr_experts(tmp_path_factory.mktemp("cartpole"), {"data.npz": 0}) / "data.npz"


@pytest.fixture(scope="module")
def acrobot(tmp_path_factory) -> Path:
    """1000 analytic Acrobot experts (configs/expert_cql_acrobot.yaml's generation), one 10-step episode each."""
    generate = load_yaml(ROOT / "configs" / "expert_cql_acrobot.yaml")["data"]["generate"]
    out = tmp_path_factory.mktemp("acrobot")
    _dataset({"pipeline": "dataset", **generate}, [f"out_dir={out}", "experts.max_episode_steps=10",
                                                  "max_episode_steps=10", "trajectories_per_expert=1", "progress=false"])
    return out / "dataset.npz"


@pytest.fixture(scope="module")
def lunarlander(tmp_path_factory) -> Path:
    """1200 heuristic LunarLander experts (configs/dataset_lunarlander_analytic.yaml on 400 of its settings: enough
    for the stable-prefix release's m p_min check), one 10-step episode each."""
    pytest.importorskip("Box2D")
    out = tmp_path_factory.mktemp("lunarlander")
    _dataset(load_yaml(ROOT / "configs" / "dataset_lunarlander_analytic.yaml"), [
        f"out_dir={out}", "experts.n_settings=400", "experts.eval_episodes=1", "experts.max_episode_steps=12",
        "experts.env_workers=1", "trajectories_per_expert=1", "max_episode_steps=10", "progress=false"])
    return out / "dataset.npz"


def _dataset(config: dict, overrides: list[str]) -> None:
    """Run the dataset pipeline on ``config`` with ``overrides`` (the repository's own generator)."""
    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    pipeline = get_pipeline("dataset")
    with contextlib.redirect_stdout(io.StringIO()):
        pipeline.run(from_dict(pipeline.config_cls, apply_overrides(config, overrides)))


def _train_overrides(path: Path, tmp_path: Path, request) -> list[str]:
    """A train config's tiny-scale overrides (no run_dir): its data, then the scale."""
    name, config = path.stem, load_yaml(path)
    data = config.get("data", {})
    if "path" in data and name not in DATA:
        raise LookupError(f"configs/{path.name} reads {data['path']}: name the tiny dataset it reads in DATA in "
                          "tests/test_every_config.py")
    overrides = [f"data.path={request.getfixturevalue(DATA[name])}"] if name in DATA else []
    if data.get("format") == "table":
        overrides += TABLE
    else:
        overrides += TRAIN
        if "generate" in data:
            overrides += [f"data.generate.out_dir={tmp_path / 'data'}", *GENERATE]
            if data["generate"]["experts"].get("family") == "ppo" and "ray" in data["generate"]["experts"]:
                overrides += FULL
    return overrides + EXTRA.get(name, [])


def _header_command(path: Path, command: str) -> list[str]:
    """The words after ``dporl COMMAND`` on the config's header line that shows how to run it."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        words = line.lstrip("# ").split()
        if words[:2] == ["dporl", command]:
            return words[2:]
    raise LookupError(f"configs/{path.name}: its header names no `dporl {command}` command")


def recipe(path: Path, tmp_path: Path, request) -> tuple[list[str], list[str]]:
    """(the command's arguments, the overrides) that run the config at a tiny scale."""
    name, config = path.stem, load_yaml(path)
    kind = config.get("pipeline", "tune")
    if kind == "dataset":
        family = config["experts"]["family"]
        env_id = config["experts"]["env_id"]
        if family == "ppo" and env_id not in PPO_DATASET:
            raise LookupError(f"configs/{path.name}: no tiny PPO recipe for {env_id} in tests/test_every_config.py")
        extra = PPO_DATASET[env_id] if family == "ppo" else []
        return ["train", "--config", str(path)], [f"out_dir={tmp_path / 'out'}", *DATASET, *extra, *EXTRA.get(name, [])]
    if kind == "train":
        return ["train", "--config", str(path)], [f"run_dir={tmp_path / 'run'}",
                                                  *_train_overrides(path, tmp_path, request)]
    if kind == "fnq":
        return ["train", "--config", str(path)], [f"run_dir={tmp_path / 'run'}", *FNQ, *EXTRA.get(name, [])]
    if kind == "ope":
        return ["train", "--config", str(path)], [f"run_dir={tmp_path / 'run'}", *OPE, *EXTRA.get(name, [])]
    if kind == "sweep":  # the base's tiny recipe appended to the sweep's own overrides; the first budget, one seed
        base = _train_overrides(path.parent / config["base"], tmp_path, request)
        return ["sweep", "--config", str(path)], [
            f"out_dir={tmp_path / 'run'}", f"overrides={json.dumps([*config.get('overrides', []), *base])}",
            f"epsilons=[{config['epsilons'][0]}]", *SWEEP, *EXTRA.get(name, [])]
    if kind == "tune":  # the command its header shows: dporl tune --config BASE --space THIS [overrides]
        words = _header_command(path, "tune")
        base = ROOT / words[words.index("--config") + 1]
        rest = [w for w in words[words.index("--space") + 2:] if "=" in w]
        return ["tune", "--config", str(base), "--space", str(path)], [
            *rest, *_train_overrides(base, tmp_path, request), f"tune.run_dir={tmp_path / 'run'}", *TUNE,
            *EXTRA.get(name, [])]
    raise LookupError(f"configs/{path.name}: no tiny-scale recipe for pipeline {kind!r} in tests/test_every_config.py")


def _guarantee(stdout: str) -> float:
    """The epsilon of the one guarantee the run printed (its report and its last line state the same one)."""
    found = {float(m.group(1)) for m in GUARANTEE.finditer(stdout)}
    assert len(found) == 1, stdout[-3000:]
    return found.pop()


RELEASE = {"train": ["summary.json", "privacy_report.json", "policy/policy.json", "policy/weights.pt"],
           "stable_prefix": ["release.json", "d_stable.npz"]}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_runs_at_tiny_scale(path, tmp_path, monkeypatch, capsys, request):
    monkeypatch.chdir(ROOT)  # the configs name each other relative to the repository root
    args, overrides = recipe(path, tmp_path, request)
    rc = main([*args, *overrides])
    out, err = capsys.readouterr()
    assert rc == 0, f"configs/{path.name} exited {rc}: {err[-2000:]}"
    run = tmp_path / "run"
    if args[0] == "tune":
        base = apply_overrides(load_yaml(args[2]), [o for o in overrides if not o.startswith("tune.")])
        assert 0 < _guarantee(out) <= base["epsilon"] + 1e-9
        assert (run / "release" / "summary.json").exists() and (run / "release" / "policy" / "policy.json").exists()
        return
    config = apply_overrides(load_yaml(path), overrides)
    kind = config["pipeline"]
    if kind == "dataset":
        assert (tmp_path / "out" / "dataset.npz").stat().st_size > 0 and (tmp_path / "out" / "experts.pt").exists()
    elif kind == "train":
        assert 0 < _guarantee(out) <= config["epsilon"] + 1e-9
        expected = RELEASE["train"] + (RELEASE["stable_prefix"] if config["method"] in ("stable_only", "mixed") else [])
        missing = [name for name in expected if not (run / "release" / name).is_file()]
        assert not missing, f"release/ lacks {missing}"
    elif kind == "sweep":
        with open(run / "runs.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert {row["method"] for row in rows} == set(config["methods"]), rows
        for row in rows:
            assert math.isfinite(float(row["return"])), row
            if row["method"] != "non_private":  # every private run within its budget
                assert 0 < float(row["guarantee_epsilon"]) <= float(row["epsilon"]) + 1e-9, row
        assert (run / "results.md").stat().st_size > 0
    elif kind == "fnq":
        # One line per run: "NAME (privacy unit: reward): (eps, delta)", or NO GUARANTEE for the paper's mechanism.
        # Run names: METHOD, METHOD_epsE, or (sigma sweeps) METHOD_sigmaS_JJ.
        runs = re.findall(r"^(\S+) \(privacy unit: reward\): (.*)$", out, re.MULTILINE)
        methods = sorted(config["methods"], key=len, reverse=True)
        named = [(next(m for m in methods if name == m or name.startswith(m + "_")), name, claim)
                 for name, claim in runs]
        assert {method for method, _, _ in named} == set(config["methods"]), out[-3000:]
        for method, name, claim in named:
            budget = re.search(r"_eps([0-9.e+]+)$", name)
            if method in ("non_private", "fnq_paper"):
                assert claim.startswith("NO GUARANTEE"), claim
            elif budget:
                epsilon = float(claim.strip("()").split(",")[0])
                assert 0 < epsilon <= float(budget.group(1)) + 1e-9, claim
        released = list(run.glob("*/seed*/release/released.pt"))
        assert len(released) == len(runs), released
    elif kind == "ope":
        summary = json.loads((run / "curator" / "summary.json").read_text())
        budget, rows = summary["config"]["epsilon"], summary["table"]
        private = [row for row in rows if row["epsilon"]]  # None: non-private; 0: data-free
        assert private and all(0 < row["epsilon"] <= budget + 1e-9 for row in private), rows
        assert all(math.isfinite(row["mspbe_mean"]) for row in rows), rows
        assert (run / "curator" / "results.md").exists()
        with open(run / "curator" / "results.csv", newline="") as handle:  # one row per table row, columns intact
            table = list(csv.DictReader(handle))
        assert [r["method"] for r in table] == [row["method"] for row in rows]
        assert all(None not in r and r["m"] == str(row["m"]) for r, row in zip(table, rows)), table
    else:
        raise AssertionError(f"configs/{path.name}: no check for pipeline {kind!r}")
