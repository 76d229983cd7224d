import json
import math

import pytest
import torch

from dporl.algos.gpope import released_theta
from dporl.algos.lstd import lstd, td_statistics, td_terms
from dporl.eval.ope_metrics import mspbe
from dporl.eval.ope_problems import ChainSettings, chain_problem, padded_data
from dporl.pipelines import get_pipeline
from dporl.pipelines.ope import OPEConfig
from dporl.privacy.accountants import REPLACE_ONE, epsilon_for
from dporl.privacy.events import PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent
from dporl.privacy.relations import epsilon_for_relation
from dporl.train.checkpoint import load_checkpoint
from dporl.utils.config import from_dict, load_yaml
from dporl.utils.validation import ValidationError


def tiny_config(tmp_path, **overrides):
    data = {
        "run_dir": str(tmp_path / "run"), "trials": 1, "m_values": [20], "noise_seed": 5, "progress": False,
        "chain": {"n_states": 6},
        "gpope": {"step_size_grid": [0.05], "clip_quantile_grid": [0.5], "epochs_grid": [1.0],
                  "step_size_multipliers": [1.0]},
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
    for name in private:  # every private method at the one relation of the comparison: replace-one
        assert 0 < methods[name]["epsilon"] <= config.epsilon * (1 + 1e-9), name
        assert methods[name]["epsilon"] == methods[name]["epsilon_replace_one"]
        assert math.isfinite(methods[name]["mspbe_mean"])

    # The GPOPE run's ledger (in its checkpoint) equals a fresh analysis of the event its source states, and the
    # replace-one epsilon reported is the conversion of exactly those events.
    checkpoint = load_checkpoint(run_dir / "m20" / "trial0" / "gpope_x1" / "curator" / "checkpoints" / "last.pt")
    run_summary = json.loads((run_dir / "m20" / "trial0" / "gpope_x1" / "curator" / "train_summary.json").read_text())
    sigma, steps = run_summary["noise_multiplier"], run_summary["budget_steps"]
    assert steps == 20  # one pass, one trajectory per update
    event = (PoissonGaussianEvent(sigma, 1 / 20) if mode == "poisson"
             else SampledWithoutReplacementGaussianEvent(sigma / 2, 1, 20))
    stage = run_summary["privacy"]["stages"][0]
    assert stage["unit"] == "trajectory"
    assert stage["epsilon"] == pytest.approx(epsilon_for([(event, steps)], config.delta, "rdp"), rel=1e-12)
    assert methods["gpope (1x step)"]["epsilon"] == pytest.approx(
        epsilon_for_relation([(event, steps)], config.delta, REPLACE_ONE), rel=1e-12)
    if mode == "paper":
        assert methods["gpope (1x step)"]["paper_lemma1_epsilon"] > 0
        assert math.isnan(methods["gpope (1x step)"]["epsilon_add_remove"])  # replace-one says nothing of it
    else:
        assert methods["gpope (1x step)"]["epsilon_add_remove"] == pytest.approx(stage["epsilon"], rel=1e-12)
    text = (run_dir / "curator" / "results.md").read_text()
    assert "replace one trajectory" in text and "for reference" in text

    # evaluate.py's hook recomputes the released (tail-averaged) estimate's exact MSPBE from the checkpoint alone.
    metrics = get_pipeline("ope").evaluate(checkpoint, episodes=1, seed=0, out_dir=tmp_path / "eval")
    problem = chain_problem(config.chain, config.gamma)
    assert int(checkpoint["algorithm"]["n_averaged"]) == 10  # the last half of 20 iterates
    expected = float(mspbe(released_theta(checkpoint["algorithm"]), problem.stats))
    assert metrics["mspbe"] == pytest.approx(expected, rel=1e-12)
    assert metrics["mspbe"] == pytest.approx(methods["gpope (1x step)"]["mspbe_mean"], rel=1e-6)
    assert (tmp_path / "eval" / "ope_eval.json").exists()


def test_tuning_grid_is_public_and_not_degenerate(tmp_path):
    # The clip norms come from quantiles of the public gradient norms, so the 0.5-quantile leaves about half of
    # them unclipped (a grid below every norm made only lr * h matter); every grid point is run and scored.
    from dporl.pipelines.ope.runners import public_gradient_norms

    config = tiny_config(tmp_path, m_values=[40], gpope={"clip_quantile_grid": [0.5, 0.9], "epochs_grid": [1.0, 3.0],
                                                         "step_size_grid": [0.05, 0.5]},
                         output_perturbation={"methods": []})
    summary = get_pipeline("ope").run(config)
    tuned = summary["tuned"]["40"]
    assert len(tuned["tuning_scores"]) == 8 and all(math.isfinite(p["score"]) for p in tuned["tuning_scores"])
    assert (tmp_path / "run" / "curator" / "step_size_sensitivity.png").exists()
    problem = chain_problem(config.chain, config.gamma)
    from dporl.pipelines.ope import PUBLIC_DRAW, data_generator

    public = padded_data(problem.sample(40, data_generator(config.seed, 40, PUBLIC_DRAW)))
    norms = public_gradient_norms(problem, public, config.gamma)
    assert len(norms) == 80  # 40 trajectories at theta = 0 and at the public LSTD solution
    quantiles = {q: float(torch.quantile(norms.double(), q)) for q in (0.5, 0.9)}
    assert tuned["clip_norm"] == pytest.approx(quantiles[tuned["clip_quantile"]], rel=1e-12)
    clipped = float((norms > tuned["clip_norm"]).double().mean())
    assert clipped <= 0.5 + 1 / 80  # at most half the public gradients are clipped at the chosen quantile
    assert tuned["epochs"] in (1.0, 3.0) and tuned["steps"] == round(tuned["epochs"] * 40)


def test_chain_sampler_matches_the_exact_statistics(tmp_path):
    # Sample statistics of 4000 trajectories vs the exact A, b, C under the on-policy distribution: entries are
    # averages of O(10^5) transitions, so their standard errors are ~1e-3 of the entry scale; 0.02 is > 5 sigma.
    config = tiny_config(tmp_path)
    problem = chain_problem(config.chain, config.gamma)
    dataset = problem.sample(4000, torch.Generator().manual_seed(0))
    assert dataset.n_episodes == 4000 and dataset.terminations.sum() == 4000
    data = padded_data(dataset)
    stats = td_statistics(td_terms(problem.features, data, dtype=torch.float64), config.gamma, weighting="transition")
    for name in ("A", "b", "C"):
        torch.testing.assert_close(getattr(stats, name), getattr(problem.stats, name), atol=0.02, rtol=0)


def test_dp_lsw_puts_no_weight_on_the_absorbing_state():
    # Balle et al. set w_s = 0 where no trajectory can go. The chain's absorbing state ends every episode and is
    # never the origin of a transition: with w = 1 there, phi(k) >= 1 for every k, so psi >= 1 and sigma never
    # falls below alpha F_max ||pinv|| (247 at eps 0.1, delta 1e-5). With the problem's public weights it does.
    from dporl.algos.dp_lsw_lsl import dp_lsw, dp_lsw_sigma, first_visit_returns
    from dporl.privacy.noise import NoiseSource
    from dporl.privacy.output_perturbation import smooth_sensitivity_constants

    problem = chain_problem(ChainSettings(), 0.99)
    weights = problem.lsw_weights
    assert weights[-1] == 0 and bool((weights[:-1] == 1).all())
    data = padded_data(problem.sample(20_000, torch.Generator().manual_seed(1)))
    visits = first_visit_returns(data, problem.n_states, 0.99, 1.0)
    assert int(visits.visit_counts[-1]) == 0  # no trajectory ever visits it, at any m
    alpha, _ = smooth_sensitivity_constants(0.1, 1e-5, problem.n_states)
    floor = alpha * 1.0 * 1.0  # alpha F_max ||(Gamma^1/2 Phi)^+|| with tabular Phi and unit weights
    ones, psi_ones = dp_lsw_sigma(visits.visit_counts, problem.feature_matrix, torch.ones(40), 0.1, 1e-5, 1.0)
    zero, psi_zero = dp_lsw_sigma(visits.visit_counts, problem.feature_matrix, weights, 0.1, 1e-5, 1.0)
    assert psi_ones >= 1.0 and ones >= floor
    # The absorbing state adds exactly 1 to phi(k) for every k; without it sigma drops (~12% at this m), and the gap
    # grows with m (the issue measured 7% at m = 1e4 and 1.9x at 1e5): five times the visit counts is m ~ 1e5.
    _, beta = smooth_sensitivity_constants(0.1, 1e-5, problem.n_states)
    k = torch.arange(int(visits.visit_counts.max()) + 1, dtype=torch.float64).unsqueeze(1)
    phi_zero = (weights / (visits.visit_counts.double() - k).clamp_min(1.0) ** 2).sum(1)
    assert psi_ones == pytest.approx(float((torch.exp(-beta * k.squeeze(1)) * (phi_zero + 1)).max()), rel=1e-12)
    assert zero < 0.95 * ones
    larger = [dp_lsw_sigma(5 * visits.visit_counts, problem.feature_matrix, w, 0.1, 1e-5, 1.0)[0]
              for w in (torch.ones(40), weights)]
    assert larger[0] / larger[1] > 1.5 * ones / zero
    release = dp_lsw(visits, problem.feature_matrix, epsilon=0.1, delta=1e-5, return_bound=1.0,
                     noise=NoiseSource(0), weights=weights)
    assert release.sigma == pytest.approx(zero, rel=1e-12)
    with pytest.raises(ValidationError, match="positive"):
        dp_lsw(visits, problem.feature_matrix, epsilon=0.1, delta=1e-5, return_bound=1.0, noise=NoiseSource(0),
               weights=torch.zeros(40))
    with pytest.raises(ValidationError, match="weights"):
        dp_lsw(visits, problem.feature_matrix, epsilon=0.1, delta=1e-5, return_bound=1.0, noise=NoiseSource(0),
               weights=-weights)


def test_config_files_parse_and_bad_values_fail(tmp_path):
    for name in ("ope_chain", "ope_chain_tiny", "ope_chain_paper_scale", "ope_mountain_car",
                 "ope_mountain_car_off_policy", "ope_hiv"):
        config = from_dict(OPEConfig, load_yaml(f"configs/{name}.yaml"))
        assert config.pipeline == "ope"
    with pytest.raises(ValidationError, match="output_perturbation.methods"):
        tiny_config(tmp_path, output_perturbation={"methods": ["dp_lsx"]})
    with pytest.raises(ValidationError, match="gpope.accountant"):
        tiny_config(tmp_path, gpope={"mode": "paper", "accountant": "prv"})
    with pytest.raises(ValidationError, match="gpope.relation"):
        tiny_config(tmp_path, gpope={"mode": "paper", "relation": "add_remove"})
    with pytest.raises(ValidationError, match="gpope.noise_multiplier"):
        tiny_config(tmp_path, gpope={"noise_multiplier": 2.0})
    with pytest.raises(ValidationError, match="clip_quantile_grid"):
        tiny_config(tmp_path, gpope={"clip_quantile_grid": [1.5]})
    with pytest.raises(ValidationError, match="unknown key"):
        tiny_config(tmp_path, gpope={"stepsize": 0.1})
    with pytest.raises(ValidationError, match="hiv.coordinates"):
        tiny_config(tmp_path, hiv={"coordinates": [0, 6, 5]})
    with pytest.raises(ValidationError, match="hiv.low"):
        tiny_config(tmp_path, hiv={"low": [4.0, 0.0]})


def test_mountain_car_off_policy_scores_both_weightings(tmp_path):
    # Continuous states: DP-LSW / DP-LSL are not run (their analysis needs a finite state space). The held-out MSPBE
    # is reported under GPOPE's per-trajectory weighting (headline) and the pooled per-transition one, each with the
    # WIS-LSTD reference fit under that weighting.
    config = tiny_config(
        tmp_path, experiment="mountain_car", m_values=[6],
        mountain_car={"fourier_order": 2, "q_learning_episodes": 1, "heldout_trajectories": 4, "off_policy": True,
                      "max_episode_steps": 15},
    )
    summary = get_pipeline("ope").run(config)
    methods = {row["method"]: row for row in summary["table"]}
    assert set(methods) == {"wis-lstd (non-private, per-trajectory weighting)",
                            "wis-lstd (non-private, per-transition weighting)", "theta = 0 (no data)",
                            "gpope (1x step)"}
    gp = methods["gpope (1x step)"]
    assert 0 < gp["epsilon"] <= config.epsilon
    assert math.isfinite(gp["mspbe_mean"]) and math.isfinite(gp["mspbe_transition_mean"])
    assert "per-trajectory weighting" in (tmp_path / "run" / "curator" / "results.md").read_text()


def test_each_weighting_has_its_own_minimiser():
    # The Mountain Car floor: with function approximation and trajectories of different lengths, LSTD under
    # one weighting zeroes that weighting's sample projected Bellman error, not the other's. Chain trajectories
    # (lengths 1 to ~100) with 8 aggregated states: scored on its own data, each LSTD solution has MSPBE 0 (to
    # solver precision) under its weighting and a clearly positive one under the other.
    from dporl.envs.features import StateAggregation
    from dporl.eval.ope_problems import HeldoutMSPBE

    problem = chain_problem(ChainSettings(), 0.99)
    data = padded_data(problem.sample(500, torch.Generator().manual_seed(2)))
    features = StateAggregation([0.0], [40.0], [8])
    score = HeldoutMSPBE(features, None, 0.99, data)
    by_trajectory = score(lstd(features, data, 0.99, weighting="trajectory"))
    by_transition = score(lstd(features, data, 0.99, weighting="transition"))
    assert by_trajectory["mspbe"] < 1e-12 < 1e-6 < by_trajectory["mspbe_transition"]
    assert by_transition["mspbe_transition"] < 1e-12 < 1e-6 < by_transition["mspbe"]


def test_given_noise_multiplier_runs_the_most_steps_the_budget_allows(tmp_path):
    from dporl.privacy.calibration import max_steps

    config = tiny_config(tmp_path, epsilon=1.0, gpope={"noise_multiplier": 2.0, "relation": "add_remove"},
                         output_perturbation={"methods": []})
    summary = get_pipeline("ope").run(config)
    gpope_row = next(row for row in summary["table"] if row["method"].startswith("gpope"))
    run_summary = json.loads(
        (tmp_path / "run" / "m20" / "trial0" / "gpope_x1" / "curator" / "train_summary.json").read_text())
    allowed = max_steps(PoissonGaussianEvent(2.0, 1 / 20), 1.0, config.delta, mechanism="rdp")
    assert run_summary["steps"] == allowed > 20
    assert run_summary["noise_multiplier"] == 2.0
    assert gpope_row["epsilon"] <= 1.0 and gpope_row["epsilon"] == gpope_row["epsilon_add_remove"]


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
    from dporl.eval.ope_metrics import relative_mspbe
    from dporl.eval.ope_problems import hiv_problem

    config = tiny_config(
        tmp_path, experiment="hiv", m_values=[6], gamma=0.9,
        hiv={"horizon": 4, "fqi_patients": 4, "fqi_iterations": 3, "heldout_trajectories": 9},
    )
    summary = get_pipeline("ope").run(config)
    methods = {row["method"]: row for row in summary["table"]}
    assert {"theta = 0 (no data)", "gpope (1x step)"} < set(methods)
    assert 0 < methods["gpope (1x step)"]["epsilon"] <= config.epsilon
    assert all(math.isfinite(row["mspbe_mean"]) for row in summary["table"])
    assert "HIV treatment" in (tmp_path / "run" / "curator" / "results.md").read_text()

    # Logged log-probabilities are the behaviour's (softmax of Q); the target is greedy w.r.t. the same Q.
    problem = hiv_problem(config.hiv, config.gamma, config.seed)
    data = padded_data(problem.sample(5, torch.Generator().manual_seed(1)))
    assert data["observations"].shape == (5, 5, 6) and not data["terminated"].any()
    states = data["observations"][:, :-1]
    behaviour = problem.behaviour(states).gather(-1, data["actions"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(data["behavior_log_probs"].double(), behaviour.log(), atol=1e-6, rtol=0)
    q = problem.features(states).double() @ problem.behaviour.q_weights.T
    assert torch.equal(problem.target_policy(states).argmax(-1), q.argmax(-1))

    # evaluate.py's hook rebuilds the same (seeded, public) problem and rescores the released theta.
    checkpoint = load_checkpoint(tmp_path / "run" / "m6" / "trial0" / "gpope_x1" / "curator" / "checkpoints" / "last.pt")
    metrics = get_pipeline("ope").evaluate(checkpoint, episodes=1, seed=0, out_dir=tmp_path / "eval")
    assert metrics["mspbe"] == pytest.approx(problem.metrics(released_theta(checkpoint["algorithm"]))["mspbe"],
                                             rel=1e-9)

    # Rewards are stored in reward_scale units, so the reported MSPBE is the relative MSPBE of the raw problem.
    scale = config.hiv.reward_scale
    raw = td_statistics(td_terms(problem.features, {**data, "rewards": data["rewards"].double() * scale},
                                 problem.target_policy, dtype=torch.float64), config.gamma, weighting="transition")
    scaled = td_statistics(td_terms(problem.features, data, problem.target_policy, dtype=torch.float64),
                           config.gamma, weighting="transition")
    theta = torch.linspace(-1, 1, problem.features.n_features, dtype=torch.float64)
    assert float(mspbe(theta, scaled)) == pytest.approx(float(relative_mspbe(theta * scale, raw, scale)), rel=1e-6)


def test_private_draws_are_named_streams_of_one_secret_root(tmp_path, monkeypatch):
    # Every private draw (each GPOPE release's sampler and noise, each DP-LSW / DP-LSL noise) is a named stream of the
    # invocation's SecretRoot: no two mechanisms share a stream (their SeedSequences differ in entropy or spawn key),
    # no NoiseSource is seeded from an integer, and noise_seed alone moves the private estimates (public data and the
    # non-private references stay put).
    from dporl.privacy import noise as noise_module
    from dporl.privacy.randomness import SecretRoot

    handed_out, int_seeded = [], []
    sequence, noise_init = SecretRoot.sequence, noise_module.NoiseSource.__init__

    def recording_sequence(self, name):
        seq = sequence(self, name)
        handed_out.append((name, seq.entropy, seq.spawn_key))
        return seq

    def recording_init(self, seed=None, **kwargs):
        if seed is not None:
            int_seeded.append(seed)
        noise_init(self, seed, **kwargs)

    monkeypatch.setattr(SecretRoot, "sequence", recording_sequence)
    monkeypatch.setattr(noise_module.NoiseSource, "__init__", recording_init)
    multipliers = [1.0, 0.1]
    config = tiny_config(tmp_path / "a", trials=2, gpope={"step_size_multipliers": multipliers})
    first = {row["method"]: row for row in get_pipeline("ope").run(config)["table"]}
    assert int_seeded == []
    streams = [(entropy, key) for _, entropy, key in handed_out]
    assert len(streams) == len(set(streams))  # never two mechanisms on one stream
    names = {name for name, _, _ in handed_out}
    for trial in range(2):
        assert {f"gpope/m20/trial{trial}/x{x!r}" for x in multipliers} <= names  # a child root per release
        assert {f"{method}/m20/trial{trial}/noise" for method in ("dp_lsw", "dp_lsl")} <= names
    # Each child root hands out its Trainer's sampler and noise streams: one pair per GPOPE release (2 trials x 2
    # multipliers; a one-point grid needs no tuning run).
    for stream in ("train/sampler", "train/noise"):
        assert sum(name == stream for name, _, _ in handed_out) == 2 * len(multipliers)

    again = {row["method"]: row for row in get_pipeline("ope").run(
        tiny_config(tmp_path / "b", trials=2, gpope={"step_size_multipliers": multipliers}))["table"]}
    other = {row["method"]: row for row in get_pipeline("ope").run(
        tiny_config(tmp_path / "c", trials=2, noise_seed=6, gpope={"step_size_multipliers": multipliers}))["table"]}
    private = ("gpope (1x step)", "gpope (0.1x step)", "dp_lsw", "dp_lsl")
    for name in private:
        assert again[name]["mspbe_mean"] == first[name]["mspbe_mean"]  # a fixed noise_seed reproduces the run
        assert other[name]["mspbe_mean"] != first[name]["mspbe_mean"]  # continuous noise: equal with probability 0
    for name in ("lstd (non-private)", "theta = 0 (no data)"):
        assert other[name]["mspbe_mean"] == first[name]["mspbe_mean"]
