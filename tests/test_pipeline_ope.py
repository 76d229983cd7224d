import json
import math

import pytest
import torch

from dporl.algos.lstd import td_statistics, td_terms
from dporl.eval.ope_metrics import mspbe
from dporl.pipelines import get_pipeline
from dporl.pipelines.ope import OPEConfig, chain_problem
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.events import PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent
from dporl.train.checkpoint import load_checkpoint
from dporl.utils.config import from_dict, load_yaml
from dporl.utils.validation import ValidationError


def tiny_config(tmp_path, **overrides):
    data = {
        "run_dir": str(tmp_path / "run"), "trials": 1, "m_values": [20], "noise_seed": 5, "progress": False,
        "chain": {"n_states": 6},
        "gpope": {"step_size_grid": [0.05], "clip_norm_grid": [0.01], "step_size_multipliers": [1.0]},
        "output_perturbation": {"lsl_lambda_grid": [10.0]},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(OPEConfig, data)


@pytest.mark.parametrize("mode", ["poisson", "paper"])
def test_chain_pipeline_end_to_end(tmp_path, mode):
    # Paper mode (replace-one, one trajectory out of 20 per step) cannot reach epsilon 0.1 in 20 steps with any
    # sensible noise, so it runs at epsilon 2 and, to keep the test short, without the output-perturbation methods.
    if mode == "poisson":
        config = tiny_config(tmp_path)
        private = ("gpope (1x step)", "dp_lsw", "dp_lsl")
    else:
        config = tiny_config(tmp_path, epsilon=2.0, gpope={"mode": mode}, output_perturbation={"methods": []})
        private = ("gpope (1x step)",)
    summary = get_pipeline("ope").run(config)
    run_dir = tmp_path / "run"
    for name in ("results.csv", "results.md", "mspbe_vs_m.png", "rmse_vs_m.png", "summary.json"):
        assert (run_dir / "curator" / name).exists(), name
    methods = {row["method"]: row for row in summary["table"]}
    assert set(methods) == {"lstd (non-private)", "theta = 0 (no data)", *private}
    for name in private:
        assert 0 < methods[name]["epsilon"] <= config.epsilon * (1 + 1e-9), name
        assert math.isfinite(methods[name]["mspbe_mean"])

    # The GPOPE run's ledger (in its checkpoint) equals a fresh analysis of the event its source states.
    checkpoint = load_checkpoint(run_dir / "m20" / "trial0" / "gpope_x1" / "curator" / "checkpoints" / "last.pt")
    run_summary = json.loads((run_dir / "m20" / "trial0" / "gpope_x1" / "curator" / "train_summary.json").read_text())
    sigma, steps = run_summary["noise_multiplier"], run_summary["budget_steps"]
    event = (PoissonGaussianEvent(sigma, 1 / 20) if mode == "poisson"
             else SampledWithoutReplacementGaussianEvent(sigma / 2, 1, 20))
    stage = run_summary["privacy"]["stages"][0]
    assert stage["unit"] == "trajectory"
    assert stage["epsilon"] == pytest.approx(epsilon_for([(event, steps)], config.delta, "rdp"), rel=1e-12)
    if mode == "paper":
        assert methods["gpope (1x step)"]["paper_lemma1_epsilon"] > 0

    # evaluate.py's hook recomputes the released estimate's exact MSPBE from the checkpoint alone.
    metrics = get_pipeline("ope").evaluate(checkpoint, episodes=1, seed=0, out_dir=tmp_path / "eval")
    problem = chain_problem(config)
    expected = float(mspbe(checkpoint["algorithm"]["theta"], problem.stats))
    assert metrics["mspbe"] == pytest.approx(expected, rel=1e-12)
    assert (tmp_path / "eval" / "ope_eval.json").exists()


def test_chain_sampler_matches_the_exact_statistics(tmp_path):
    # Sample statistics of 4000 trajectories vs the exact A, b, C under the on-policy distribution: entries are
    # averages of O(10^5) transitions, so their standard errors are ~1e-3 of the entry scale; 0.02 is > 5 sigma.
    config = tiny_config(tmp_path)
    problem = chain_problem(config)
    data = problem.sample(4000, torch.Generator().manual_seed(0))
    assert bool(data["terminated"].all())
    stats = td_statistics(td_terms(problem.features, data, dtype=torch.float64), config.gamma, weighting="transition")
    for name in ("A", "b", "C"):
        torch.testing.assert_close(getattr(stats, name), getattr(problem.stats, name), atol=0.02, rtol=0)


def test_config_files_parse_and_bad_values_fail(tmp_path):
    for name in ("ope_chain", "ope_chain_tiny", "ope_mountain_car", "ope_mountain_car_off_policy", "ope_hiv"):
        config = from_dict(OPEConfig, load_yaml(f"configs/{name}.yaml"))
        assert config.pipeline == "ope"
    with pytest.raises(ValidationError, match="output_perturbation.methods"):
        tiny_config(tmp_path, output_perturbation={"methods": ["dp_lsx"]})
    with pytest.raises(ValidationError, match="gpope.accountant"):
        tiny_config(tmp_path, gpope={"mode": "paper", "accountant": "prv"})
    with pytest.raises(ValidationError, match="unknown key"):
        tiny_config(tmp_path, gpope={"stepsize": 0.1})
    with pytest.raises(ValidationError, match="hiv.coordinates"):
        tiny_config(tmp_path, hiv={"coordinates": [0, 6, 5]})
    with pytest.raises(ValidationError, match="hiv.low"):
        tiny_config(tmp_path, hiv={"low": [4.0, 0.0]})


def test_mountain_car_off_policy_runs_gpope_against_wis_lstd_only(tmp_path):
    # Continuous states: DP-LSW / DP-LSL are not run (their analysis needs a finite state space).
    config = tiny_config(
        tmp_path, experiment="mountain_car", m_values=[6],
        mountain_car={"fourier_order": 2, "q_learning_episodes": 1, "heldout_trajectories": 4, "off_policy": True,
                      "max_episode_steps": 15},
    )
    summary = get_pipeline("ope").run(config)
    methods = {row["method"]: row for row in summary["table"]}
    assert set(methods) == {"wis-lstd (non-private)", "theta = 0 (no data)", "gpope (1x step)"}
    assert 0 < methods["gpope (1x step)"]["epsilon"] <= config.epsilon
    assert math.isfinite(methods["gpope (1x step)"]["mspbe_mean"])


def test_given_noise_multiplier_runs_the_most_steps_the_budget_allows(tmp_path):
    from dporl.privacy.calibration import max_steps

    config = tiny_config(tmp_path, epsilon=1.0, gpope={"noise_multiplier": 2.0}, output_perturbation={"methods": []})
    summary = get_pipeline("ope").run(config)
    gpope_row = next(row for row in summary["table"] if row["method"].startswith("gpope"))
    run_summary = json.loads((tmp_path / "run" / "m20" / "trial0" / "gpope_x1" / "curator" / "train_summary.json").read_text())
    allowed = max_steps(PoissonGaussianEvent(2.0, 1 / 20), 1.0, config.delta, mechanism="rdp")
    assert run_summary["steps"] == allowed > 20
    assert run_summary["noise_multiplier"] == 2.0
    assert gpope_row["epsilon"] <= 1.0


def test_linear_fitted_q_reaches_the_optimal_q_of_a_tabular_mdp():
    # Two states, two actions: action 0 stays, action 1 moves to the other state; reward 1 for acting in state 1.
    # With one-hot (s, a) data and a negligible ridge, fitted Q-iteration is value iteration on Q: compare with
    # value iteration run here on the same model (error after K steps <= gamma^K / (1 - gamma) ~ 1e-8).
    from dporl.algos.fitted_q import linear_fitted_q

    gamma, iterations = 0.9, 200
    states = torch.tensor([0, 0, 1, 1])
    actions = torch.tensor([0, 1, 0, 1])
    next_states = torch.tensor([0, 1, 1, 0])
    rewards = (states == 1).double()
    q = torch.zeros(2, 2, dtype=torch.float64)
    for _ in range(iterations):
        q = rewards.view(2, 2) + gamma * q.max(1).values[next_states].view(2, 2)
    phi = torch.nn.functional.one_hot(states, 2).double()
    weights = linear_fitted_q(phi, actions, rewards, torch.nn.functional.one_hot(next_states, 2).double(),
                              torch.ones(4), n_actions=2, gamma=gamma, iterations=iterations, ridge=1e-12)
    torch.testing.assert_close(weights.T, q, atol=1e-6, rtol=0)  # weights[a, s] = Q(s, a)
    with pytest.raises(ValidationError, match="actions"):
        linear_fitted_q(phi, actions + 1, rewards, phi, torch.ones(4), n_actions=2, gamma=gamma, iterations=1)


def test_hiv_off_policy_pipeline_end_to_end(tmp_path):
    from dporl.algos.lstd import td_statistics, td_terms
    from dporl.eval.ope_metrics import relative_mspbe
    from dporl.pipelines.ope import hiv_problem

    config = tiny_config(
        tmp_path, experiment="hiv", m_values=[6], gamma=0.9,
        hiv={"horizon": 4, "fqi_patients": 4, "fqi_iterations": 3, "heldout_trajectories": 9},
        gpope={"clip_norm_grid": [1.0]},
    )
    summary = get_pipeline("ope").run(config)
    methods = {row["method"]: row for row in summary["table"]}
    assert set(methods) == {"wis-lstd (non-private)", "theta = 0 (no data)", "gpope (1x step)"}
    assert 0 < methods["gpope (1x step)"]["epsilon"] <= config.epsilon
    assert all(math.isfinite(row["mspbe_mean"]) for row in summary["table"])
    assert "HIV treatment" in (tmp_path / "run" / "curator" / "results.md").read_text()

    # Logged log-probabilities are the behaviour's (softmax of Q); the target is greedy w.r.t. the same Q.
    problem = hiv_problem(config)
    data = problem.sample(5, torch.Generator().manual_seed(1))
    assert data["observations"].shape == (5, 5, 6) and not data["terminated"].any()
    states = data["observations"][:, :-1]
    behaviour = problem.behaviour(states).gather(-1, data["actions"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(data["behavior_log_probs"].double(), behaviour.log(), atol=1e-6, rtol=0)
    q = problem.features(states).double() @ problem.behaviour.q_weights.T
    assert torch.equal(problem.target_policy(states).argmax(-1), q.argmax(-1))

    # evaluate.py's hook rebuilds the same (seeded, public) problem and rescores the released theta.
    checkpoint = load_checkpoint(tmp_path / "run" / "m6" / "trial0" / "gpope_x1" / "curator" / "checkpoints" / "last.pt")
    metrics = get_pipeline("ope").evaluate(checkpoint, episodes=1, seed=0, out_dir=tmp_path / "eval")
    assert metrics["mspbe"] == pytest.approx(problem.metrics(checkpoint["algorithm"]["theta"])["mspbe"], rel=1e-9)

    # Rewards are stored in reward_scale units, so the reported MSPBE is the relative MSPBE of the raw problem.
    scale = config.hiv.reward_scale
    raw = td_statistics(td_terms(problem.features, {**data, "rewards": data["rewards"].double() * scale},
                                 problem.target_policy, dtype=torch.float64), config.gamma, weighting="transition")
    scaled = td_statistics(td_terms(problem.features, data, problem.target_policy, dtype=torch.float64),
                           config.gamma, weighting="transition")
    theta = torch.linspace(-1, 1, problem.features.n_features, dtype=torch.float64)
    assert float(mspbe(theta, scaled)) == pytest.approx(float(relative_mspbe(theta * scale, raw, scale)), rel=1e-6)
