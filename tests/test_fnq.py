import copy
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from dporl.algos.fnq import (
    EnvInteractionSource,
    FNQConfig,
    FunctionalNoiseQLearning,
    RewardClamp,
    RewardLevelSource,
    RewardPrivateQLearning,
    dataset_source,
    load_noisy_q,
    save_noisy_q,
)
from dporl.algos.fnq_baselines import GaussianRewardNoise, WholeBatchUnitSource
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.validation import PrivacyBudgetError, ValidationError


class LineEnv(gym.Env):
    """The 1-D line MDP of Wang & Hegde 2019, local so these tests do not depend on dporl.envs."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state, self.t = float(self.np_random.uniform()), 0
        return np.array([self.state], dtype=np.float32), {}

    def step(self, action):
        move = self.np_random.uniform(0, 0.25)
        self.state = min(1.0, max(0.0, self.state + (move if action == 1 else -move)))
        self.t += 1
        return np.array([self.state], dtype=np.float32), 0.5 - abs(self.state - 0.5), False, self.t >= 50, {}


def _learner(sigma=0.7, reset_every=1, seed=0):
    torch.manual_seed(seed)
    config = FNQConfig(sigma=sigma, beta=20.0, reset_every=reset_every, gamma=0.9)
    return FunctionalNoiseQLearning(1, 2, config, NoiseSource(seed))


def test_losses_are_algorithm_1_with_noisy_q_in_prediction_and_target():
    learner = _learner()
    generator = torch.Generator().manual_seed(0)
    batch = EnvInteractionSource(LineEnv(), learner.act, 16).sample(generator)
    losses = learner.row_losses(batch)
    data = batch.data
    with torch.no_grad():
        g, g_next = learner.noise(data["obs"]), learner.noise(data["next_obs"])  # stored values: no new draws
        q = learner.q_network(data["obs"]) + g
        q_next = learner.q_network(data["next_obs"]) + g_next
        target = data["rewards"] + 0.9 * (1 - data["terminated"].float()) * q_next.max(1).values
        expected = 0.5 * (q.gather(1, data["actions"].unsqueeze(1)).squeeze(1) - target) ** 2
    assert torch.allclose(losses, expected)
    assert g.abs().sum() > 0
    losses.mean().backward()  # the paths are constants: gradients reach only the network
    assert all(p.grad is not None for p in learner.q_network.parameters())


def test_online_source_acts_greedily_on_the_noisy_function_and_counts_samples():
    learner = _learner(sigma=2.0)
    source = EnvInteractionSource(LineEnv(), learner.act, 8)
    batch = source.sample(torch.Generator().manual_seed(1))
    assert batch.n_rows == 8 and not batch.private and source.env_steps == 8
    greedy = learner.function(batch.data["obs"]).argmax(1)
    assert torch.equal(greedy, batch.data["actions"])
    # Replay: 4 new transitions per update, batches of 8 drawn from the buffer.
    replay = EnvInteractionSource(LineEnv(), learner.act, 8, env_steps_per_update=4, replay_capacity=10)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        assert replay.sample(generator).n_rows == 8
    assert replay.env_steps == 12
    with pytest.raises(ValidationError, match="env_steps_per_update"):
        EnvInteractionSource(LineEnv(), learner.act, 8, env_steps_per_update=4)


def test_paths_reset_every_T_over_JB_updates():
    learner = _learner(reset_every=3)
    learner.noise(torch.rand(5, 1))
    for step in (1, 2):
        learner.on_step_end(step)
        assert learner.noise.n_points == 10
    learner.on_step_end(3)
    assert learner.noise.n_points == 0


def test_trained_function_is_released_saved_and_reloaded_with_identical_answers(tmp_path):
    learner = _learner(sigma=0.5, reset_every=4)
    source = EnvInteractionSource(LineEnv(), learner.act, 16)
    config = TrainerConfig(max_steps=6, eval_every=3, checkpoint_every=6, progress=False,
                           optimizer=OptimizerConfig(name="sgd", lr=1e-2))
    result = Trainer(learner, source, config=config, dp=None, ledger=PrivacyLedger(), run_dir=tmp_path / "run",
                     pipeline="fnq", pipeline_config={}, evaluators={}).fit()
    assert result.steps == 6 and source.env_steps == 96
    released = learner.release(NoiseSource(3))
    seen = torch.rand(20, 1)
    before = released(seen)
    save_noisy_q(tmp_path / "released.pt", released, {"note": "test"})
    loaded, metadata = load_noisy_q(tmp_path / "released.pt")
    unseen = torch.rand(7, 1)
    assert torch.equal(loaded(seen), before)
    assert torch.equal(loaded(unseen), released(unseen))
    assert metadata == {"note": "test"}
    # The released copy draws from its own generator, not the training one.
    assert released.noise.noise is not learner.noise.noise


def test_offline_variant_trains_on_logged_transitions_with_perturbed_rewards():
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    rng = np.random.default_rng(0)
    episodes = [
        {"observations": rng.uniform(size=(11, 1)).astype(np.float32), "actions": rng.integers(0, 2, 10),
         "rewards": rng.uniform(0, 0.5, 10).astype(np.float32), "terminated": False, "truncated": True,
         "unit_id": 0}
        for _ in range(3)
    ]
    dataset = TrajectoryDataset.from_episodes(episodes, DatasetMetadata("line", 2, 1, (1,)))
    perturb = GaussianRewardNoise(5.0, NoiseSource(0), n_rewards=30)
    source = dataset_source(dataset, 8, perturb)
    assert perturb.rewards_perturbed == 30  # every logged reward perturbed exactly once
    noisy = source.data["rewards"]
    assert not torch.allclose(noisy, torch.from_numpy(dataset.transitions().rewards))
    batch = source.sample(torch.Generator().manual_seed(0))
    learner = _learner()
    assert learner.row_losses(batch).shape == (8,)


def test_dpsgd_baseline_treats_the_whole_batch_as_one_unit_and_spends_its_budget(tmp_path):
    learner = _learner(sigma=0.0)
    inner = EnvInteractionSource(LineEnv(), learner.act, 16)
    source = WholeBatchUnitSource(inner)
    batch = source.sample(torch.Generator().manual_seed(0))
    assert batch.private and batch.n_units == 1 and torch.equal(batch.unit_index, torch.zeros(16, dtype=torch.long))
    # Replacing the reward function moves the clipped batch gradient by 2C: the event's multiplier is sigma / 2.
    assert source.step_event(3.0) == PoissonGaussianEvent(1.5, 1.0)
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(2.0, 1e-4), unit="reward")
    dp = DPConfig(epsilon=2.0, delta=1e-4, max_grad_norm=1.0, noise_seed=0)
    config = TrainerConfig(max_steps=5, eval_every=5, checkpoint_every=5, progress=False,
                           optimizer=OptimizerConfig(name="sgd", lr=1e-2))
    result = Trainer(learner, source, config=config, dp=dp, ledger=ledger, run_dir=tmp_path / "dp",
                     pipeline="fnq", pipeline_config={}).fit()
    assert result.steps == 5
    assert 1.5 < ledger.spent("train") <= 2.0  # the calibrated sigma spends (nearly) all of the budget


def test_bad_configs_name_their_field():
    with pytest.raises(ValidationError, match="fnq.reset_every"):
        FNQConfig(reset_every=0)
    with pytest.raises(ValidationError, match="fnq.state_low"):
        FunctionalNoiseQLearning(2, 2, FNQConfig())


def _pipeline_config(tmp_path, **overrides):
    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    pipeline = get_pipeline("fnq")
    base = {"pipeline": "fnq", "run_dir": str(tmp_path), "env_id": "dporl/Line1D-v0", "samples": 128, "batch_size": 32,
            "optimizer": {"name": "sgd", "lr": 0.05}, "eval_episodes": 2, "evaluations": 1, "noise_seed": 0,
            "progress": False}
    return pipeline, from_dict(pipeline.config_cls, {**base, **overrides})


def test_pipeline_compares_methods_at_one_certified_budget(tmp_path):
    import json

    methods = ["non_private", "random_policy", "untrained", "fnq", "fnq_paper", "input_perturbation", "dp_sgd"]
    pipeline, config = _pipeline_config(tmp_path, methods=methods, epsilons=[0.9], delta=1e-4, reset_factors=[4])
    summary = pipeline.run(config)
    results = json.loads((tmp_path / "curator" / "results.json").read_text())
    rows = {row["label"]: row for row in results["rows"]}
    assert set(rows) == set(summary["guarantees"]) == {
        "non_private", "random_policy", "untrained", "fnq_eps0.9", "fnq_paper_eps0.9", "input_perturbation_eps0.9",
        "dp_sgd_eps0.9"}
    runs = {r["label"]: r for r in results["runs"]}
    # The sound methods carry a GUARANTEE at the budget, unit "reward", neighbours by bounded change.
    for label in ("fnq_eps0.9", "input_perturbation_eps0.9", "dp_sgd_eps0.9"):
        guarantee = runs[label]["ledger"]["guarantee"]
        assert guarantee["epsilon"] <= 0.9 * (1 + 1e-9) and guarantee["unit"] == "reward", label
        assert guarantee["relation"] == "every record moved by at most a bounded amount"
    fnq = runs["fnq_eps0.9"]
    assert fnq["steps"] == 4 and fnq["privacy"]["updates"] == 4
    assert fnq["ledger"]["guarantee"]["epsilon"] > 0.85  # the calibrated z spends (nearly) the whole budget
    # Theorem 5: the paper's figure, NOT a guarantee, and the run reports NO GUARANTEE.
    paper = runs["fnq_paper_eps0.9"]
    assert paper["ledger"]["guarantee"] is None and paper["ledger"]["void"]
    claim = paper["ledger"]["paper_figures_NOT_guarantees"][0]
    assert claim["epsilon"] == 0.9 and claim["delta"] <= 1e-4 and "Theorem 5" in claim["name"]
    text = paper["ledger"]["text"]
    assert "NO GUARANTEE" in text and "the paper's figure, NOT a guarantee" in text and "GUARANTEE: (" not in text
    assert paper["privacy"]["delta_total"] <= 1e-4 and paper["privacy"]["reset_factor"] == 4
    assert paper["sigma"] == pytest.approx(paper["privacy"]["sigma"])
    assert rows["fnq_paper_eps0.9"]["guarantee"].startswith("NO GUARANTEE")
    assert rows["non_private"]["guarantee"] == "NO GUARANTEE"
    assert rows["random_policy"]["guarantee"].startswith("data-free")
    assert "90% of non-private" in (tmp_path / "curator" / "table.md").read_text()
    # What the command line prints is public: the guarantees, never a return (computed from the protected rewards).
    assert summary["guarantees"] == {label: row["guarantee"] for label, row in rows.items()}
    assert not any("return" in str(key) or "table" in str(key) for key in summary)
    # Returns are computed from the protected rewards: curator-only, never in release/.
    run = tmp_path / "fnq_eps0.9" / "seed0"
    public = json.loads((run / "release" / "train_summary.json").read_text())
    curator = json.loads((run / "curator" / "train_summary.json").read_text())
    assert not any("return" in key for key in public["metrics"]) and "return/return_mean" in curator["metrics"]
    assert public["privacy"]["guarantee"]["unit"] == "reward"
    assert (tmp_path / "curator" / "table.md").exists() and list((tmp_path / "curator").glob("*.png"))
    released, _ = load_noisy_q(tmp_path / "fnq_paper_eps0.9" / "seed0" / "release" / "released.pt")
    assert released.noise.sigma == pytest.approx(paper["sigma"])
    from dporl.train.checkpoint import load_checkpoint

    run_dir = tmp_path / "fnq_eps0.9" / "seed0"
    metrics = pipeline.evaluate(load_checkpoint(run_dir / "curator" / "checkpoints" / "last.pt"), episodes=2, seed=0,
                                out_dir=run_dir)
    assert metrics["episodes"] == 2 and metrics["label"] == "fnq_eps0.9" and (run_dir / "eval.json").exists()


def test_no_reward_level_epsilon_is_worded_as_conditional_or_comes_from_theorem_5():
    import dporl.pipelines.fnq as pipeline_module
    from dporl.privacy import functional_calibration

    for module in (pipeline_module, functional_calibration):
        source = Path(module.__file__).read_text().lower()
        assert "conditional on" not in source
    calibration = functional_calibration.smallest_tail_parameter(
        0.9, 1e-4, updates=78, batch_size=64, learning_rate=3e-4, lipschitz=4.0, reset_factor=78
    )
    assert calibration.describe().startswith("the paper's figure, NOT a guarantee")
    ledger = PrivacyLedger()
    calibration.paper_claim(ledger)
    report = ledger.report()
    assert report.guarantee is None and not ledger.stages  # a paper claim never becomes a stage or a guarantee
    assert "the paper's figure, NOT a guarantee" in report.describe()


def test_pipeline_refuses_what_it_cannot_certify(tmp_path):
    pipeline, _ = _pipeline_config(tmp_path)
    from dporl.utils.config import from_dict

    base = {"pipeline": "fnq", "run_dir": str(tmp_path), "samples": 64, "batch_size": 32, "progress": False}
    with pytest.raises(ValidationError, match="methods"):  # a sweep runs the paper's mechanism only
        pipeline.run(from_dict(pipeline.config_cls, {**base, "methods": ["fnq_paper", "dp_sgd"], "beta": 10.0}))
    with pytest.raises(ValidationError, match="epsilons"):  # Theorem 5 is one-dimensional
        pipeline.run(from_dict(pipeline.config_cls, {
            **base, "env_id": "CartPole-v1", "state_low": [-2.4, -3, -0.21, -3.5], "state_high": [2.4, 3, 0.21, 3.5],
            "epsilons": [1.0], "methods": ["fnq_paper"],
        }))
    with pytest.raises(ValidationError, match="optimizer"):  # the theorem's figure assumes plain SGD
        pipeline.run(from_dict(pipeline.config_cls, {**base, "epsilons": [1.0], "methods": ["fnq_paper"],
                                                     "optimizer": {"name": "adam"}}))
    for field, value in [("clip_norm", 0.0), ("clip_norm", -1.0), ("noise_multiplier", 0.0),
                         ("noise_multiplier", -2.0), ("td_clip", 0.0), ("td_clip", 1.5), ("reward_scale", 0.0),
                         ("reward_range", [1.0, 0.0]), ("reward_range", [0.0]), ("accountant", "moments")]:
        with pytest.raises(ValidationError, match=field):
            from_dict(pipeline.config_cls, {**base, "epsilons": [1.0], field: value})


# ----------------------------------------------------------------------------- the sound reward-level mechanism
def _sound_learner(seed=0, **config):
    torch.manual_seed(seed)
    return RewardPrivateQLearning(1, 2, FNQConfig(gamma=0.9, **config))


def _neighbour_batches(seed=0, rows=32):
    """One public history (states, actions, next states, terminal flags) with rewards r and r' (sup |r - r'| <= 1)."""
    g = torch.Generator().manual_seed(seed)
    data = {"obs": torch.rand(rows, 1, generator=g), "actions": torch.randint(0, 2, (rows,), generator=g),
            "next_obs": torch.rand(rows, 1, generator=g), "terminated": torch.rand(rows, generator=g) < 0.3}
    rewards = torch.rand(rows, generator=g) * 0.5
    shift = torch.rand(rows, generator=g) * 2 - 1  # any change within sup-distance 1
    make = lambda r: Batch(dict(data, rewards=r), torch.arange(rows), rows, private=True)  # noqa: E731
    return make(rewards), make(rewards + shift), make(rewards + 1.0)


def _clipped_mean_update(learner, batch, clip):
    """The engine's noiseless update for ``batch`` (on a copy of ``learner``, so engines' hooks never pile up)."""
    import copy

    from dporl.privacy.dpsgd import DPSGDEngine

    learner = copy.deepcopy(learner)
    engine = DPSGDEngine(learner, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=batch.n_rows,
                         noise=NoiseSource(0))
    losses, weights = learner.weighted_row_losses(batch)
    engine.private_backward(losses, batch.unit_index, batch.n_units, row_weights=weights)
    return torch.cat([p.grad.reshape(-1) for p in learner.parameters() if p.requires_grad])


@pytest.mark.parametrize("td_clip, reward_scale", [(1.0, 1.0), (0.2, 1.0), (1.0, 4.0)])
def test_sensitivity_bound_holds_empirically_for_neighbouring_reward_functions(td_clip, reward_scale):
    # Same public history and iterate, rewards r vs r' (sup |r - r'| <= 1): the clipped, TD-weighted mean updates
    # differ by at most G s, s = min(1/c, 2 kappa). The bound is tight: with r' = r + 1, large Jacobians (clipped) and
    # one repeated transition, the difference is G s up to float error.
    clip = 0.3
    learner = _sound_learner(td_clip=td_clip, reward_scale=reward_scale, hidden_sizes=[16, 16])
    bound = clip * learner.config.update_sensitivity
    assert learner.config.update_sensitivity == pytest.approx(min(1 / reward_scale, 2 * td_clip))
    for seed in range(5):
        d, d_random, d_plus_one = _neighbour_batches(seed)
        base = _clipped_mean_update(learner, d, clip)
        for neighbour in (d_random, d_plus_one):
            assert float((base - _clipped_mean_update(learner, neighbour, clip)).norm()) <= bound * (1 + 1e-5)
    # Tightness: all rows the same terminal transition whose TD error moves from -s/2 to +s/2 (inside the clip).
    rows = 16
    obs = torch.full((rows, 1), 0.4)
    q = float(learner.q_network(obs[:1])[0, 1].detach())
    half = learner.config.update_sensitivity / 2
    make = lambda r: Batch({"obs": obs, "actions": torch.ones(rows, dtype=torch.long), "next_obs": obs,  # noqa: E731
                            "terminated": torch.ones(rows, dtype=torch.bool),
                            "rewards": torch.full((rows,), r)}, torch.arange(rows), rows, True)
    r_low = (q - half) * reward_scale  # TD error +s/2; r_low + 1 moves it by 1/c to -s/2 or clips it there
    difference = _clipped_mean_update(learner, make(r_low), clip) - _clipped_mean_update(learner, make(r_low + 1.0), clip)
    assert float(difference.norm()) == pytest.approx(bound, rel=1e-4)


def test_private_update_is_the_huber_semi_gradient_plus_noise_of_std_z_g_s():
    # With G large (nothing clipped) and no noise, the engine's weighted update equals the non-private one:
    # mean_t w_t grad Q(s_t, a_t) = grad of the Huber(kappa) TD loss with a fixed target.
    learner = _sound_learner(td_clip=0.5, hidden_sizes=[8])
    batch, _, _ = _neighbour_batches(3)
    private = _clipped_mean_update(learner, batch, 1e6)
    learner.zero_grad()
    q = learner.q_network(batch.data["obs"]).gather(1, batch.data["actions"][:, None]).squeeze(1)
    with torch.no_grad():
        target = batch.data["rewards"] + 0.9 * (~batch.data["terminated"]) * learner.q_network(batch.data["next_obs"]).max(1).values
    torch.nn.functional.huber_loss(q, target, delta=0.5, reduction="sum").div(batch.n_rows).backward()
    huber = torch.cat([p.grad.reshape(-1) for p in learner.parameters() if p.requires_grad])
    torch.testing.assert_close(private, huber, rtol=1e-5, atol=1e-7)
    # The algebra of the noise: the source states multiplier sigma_e / (B s) for engine multiplier sigma_e, and the
    # engine's N(0, (sigma_e G)^2) on the sum, divided by B, is N(0, (z G s)^2) on the mean. Checked on 400 updates
    # x 33 coordinates of pure noise (weights 0): the sample std is within 2% of z G s (chi-square: sd/sqrt(2n) ~ 0.6%).
    from dporl.privacy.dpsgd import DPSGDEngine

    z, clip, rows = 3.0, 0.7, batch.n_rows
    source = RewardLevelSource(type("Inner", (), {"batch_size": rows})(), sensitivity=learner.config.update_sensitivity)
    s = learner.config.update_sensitivity
    engine_sigma = z * rows * s
    event = source.step_event(engine_sigma)
    assert event.noise_multiplier == pytest.approx(z, rel=1e-12) and event.sample_rate == 1.0
    engine = DPSGDEngine(learner, max_grad_norm=clip, noise_multiplier=engine_sigma, expected_batch_size=rows,
                         noise=NoiseSource(1))
    draws = []
    for _ in range(400):
        losses, _ = learner.weighted_row_losses(batch)
        engine.private_backward(losses, batch.unit_index, rows, row_weights=torch.zeros(rows))
        draws.append(torch.cat([p.grad.reshape(-1) for p in learner.parameters() if p.requires_grad]))
    assert float(torch.stack(draws).std()) == pytest.approx(z * clip * s, rel=0.02)


def test_accounting_matches_dp_accounting_gaussian_composed_u_times(tmp_path):
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    from dporl.privacy.accountants import epsilon_for
    from dporl.privacy.functional_calibration import (
        gaussian_noise_multiplier,
        gaussian_delta,
        update_event,
        updates_within_budget,
    )

    for z, updates in [(5.0, 20), (31.0, 78), (2.0, 400)]:
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), updates)
        pld = PLDAccountant(value_discretization_interval=1e-3)
        pld.compose(event)
        ours = epsilon_for([(update_event(z), updates)], 1e-4, "pld")
        assert ours == pytest.approx(pld.get_epsilon(1e-4), rel=1e-4)  # discretisations differ in the 6th digit
        # Both are within 0.1% above the exact value: U Gaussians of multiplier z are one of multiplier z / sqrt(U)
        # (Balle & Wang 2018's exact delta(eps)): ours is a valid eps, and 0.1% less is not.
        assert gaussian_delta(ours, z / math.sqrt(updates), 1.0) <= 1e-4 < gaussian_delta(0.999 * ours, z / math.sqrt(updates), 1.0)
        rdp = RdpAccountant()
        rdp.compose(event)
        # RDP: the same curve, converted over a different grid of orders (agree to 1%), and never below the exact eps.
        rdp_ours = epsilon_for([(update_event(z), updates)], 1e-4, "rdp")
        assert rdp_ours == pytest.approx(rdp.get_epsilon(1e-4), rel=0.01) and rdp_ours >= ours
    # Calibration: z for (0.9, 1e-4) over 78 updates fits, and 0.2% less noise would not (bisection to 0.1%).
    z = gaussian_noise_multiplier(0.9, 1e-4, 78, "pld")
    assert epsilon_for([(update_event(z), 78)], 1e-4, "pld") <= 0.9 < epsilon_for([(update_event(z * 0.998), 78)], 1e-4, "pld")
    assert updates_within_budget(z, 0.9, 1e-4, "pld", limit=1000) == 78
    assert updates_within_budget(z * 1.5, 0.9, 1e-4, "pld", limit=10_000) > 78  # more noise, more updates
    # Through the Trainer and the ledger: a run at that z spends the budget over exactly 78 events.
    learner = _sound_learner(hidden_sizes=[4])
    inner = EnvInteractionSource(LineEnv(), learner.act, 8, exploration=0.5, env_generator=torch.Generator().manual_seed(3))
    source = RewardLevelSource(inner, learner.config.update_sensitivity)
    ledger = PrivacyLedger()
    dp = DPConfig(epsilon=0.9, delta=1e-4, noise_multiplier=z * 8 * learner.config.update_sensitivity,
                  max_grad_norm=0.5, accountant="pld", noise_seed=5)
    config = TrainerConfig(max_steps=500, eval_every=1000, checkpoint_every=1000, progress=False,
                           optimizer=OptimizerConfig(name="sgd", lr=1e-2))
    result = Trainer(learner, source, config=config, dp=dp, ledger=ledger, run_dir=tmp_path / "run",
                     pipeline="fnq", pipeline_config={}).fit()
    assert result.steps == 78  # budget-driven stopping: the budget allows 78 updates at this z, not 500
    report = ledger.report()
    assert report.guarantee[0] <= 0.9 and report.unit.name == "reward" and str(report.relation).startswith("every record")
    assert report.stages[0].events == [({"type": "PoissonGaussianEvent", "noise_multiplier": pytest.approx(z),
                                         "sample_rate": 1.0}, 78)]


def test_trainer_takes_the_weighted_semi_gradient_without_an_engine():
    learner = _sound_learner(hidden_sizes=[4], td_clip=0.3)
    batch, _, _ = _neighbour_batches(4)
    batch = Batch(batch.data, batch.unit_index, batch.n_units, private=False)
    from dporl.train.trainer import Trainer as T

    trainer = T(learner, None, config=TrainerConfig(progress=False), dp=None, ledger=PrivacyLedger(), run_dir="unused",
                pipeline="fnq", pipeline_config={})
    reference = copy.deepcopy(learner)
    losses, weights = reference.weighted_row_losses(batch)
    (losses * weights).mean().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    optimizer = torch.optim.SGD(learner.parameters(), lr=1.0)
    before = [p.detach().clone() for p in learner.parameters()]
    trainer._step(batch, None, optimizer)
    step = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, learner.parameters())])
    torch.testing.assert_close(step, expected)
    assert bool(weights.abs().max() <= torch.tensor(0.3))  # clipped at kappa (in float32)


def test_targets_come_from_a_past_iterate_and_never_from_the_exploration_paths():
    learner = _sound_learner(hidden_sizes=[4], target_update_every=3, sigma=5.0, beta=10.0)
    batch, _, _ = _neighbour_batches(5)
    weights = learner.td_weights(learner.q_network(batch.data["obs"]).gather(1, batch.data["actions"][:, None]).squeeze(1), batch)
    assert learner.noise.n_points == 0  # no path was queried for the targets
    with torch.no_grad():
        for p in learner.q_network.parameters():
            p.add_(1.0)
    q = learner.q_network(batch.data["obs"]).gather(1, batch.data["actions"][:, None]).squeeze(1)
    stale = learner.td_weights(q, batch)
    learner.on_step_end(3)  # the target copy is refreshed from the (released) iterate every 3 updates
    fresh = learner.td_weights(q, batch)
    assert not torch.allclose(stale, fresh) and not torch.allclose(weights, stale)
    assert torch.equal(learner.target_network[0].weight, learner.q_network[0].weight)


# ----------------------------------------------------------------------------- input perturbation
def test_input_perturbation_releases_each_reward_once_however_often_it_is_replayed():
    learner = _sound_learner(hidden_sizes=[4])
    perturb = GaussianRewardNoise(2.0, NoiseSource(0), n_rewards=40)
    source = EnvInteractionSource(LineEnv(), learner.act, 16, env_steps_per_update=4, replay_capacity=64,
                                  reward_transform=perturb, env_generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        source.sample(generator)
    # 40 environment steps, 40 distinct noisy rewards, 160 rows served: no reward was perturbed twice.
    assert source.env_steps == perturb.rewards_perturbed == 40
    stored = source._buffer["rewards"][:40].clone()
    state = perturb.noise.state_dict()["generator"].clone()
    with pytest.raises(PrivacyBudgetError, match="n_rewards"):  # the 41st reward would exceed the calibration
        source.sample(generator)
    assert torch.equal(perturb.noise.state_dict()["generator"], state)  # refused before any draw
    assert torch.equal(source._buffer["rewards"][:40], stored)  # replayed rewards are the stored noisy ones


def test_input_perturbation_accounting_counts_distinct_rewards_offline(tmp_path):
    import json

    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    rng = np.random.default_rng(1)
    episodes = [{"observations": rng.uniform(size=(6, 1)).astype(np.float32), "actions": rng.integers(0, 2, 5),
                 "rewards": rng.uniform(0, 0.5, 5).astype(np.float32), "terminated": False, "truncated": True,
                 "unit_id": 0} for _ in range(4)]
    path = TrajectoryDataset.from_episodes(episodes, DatasetMetadata("dporl/Line1D-v0", 2, 1, (1,))).save(tmp_path / "d.npz")
    from dporl.privacy.functional_calibration import gaussian_noise_multiplier

    # 20 logged rewards, 8 updates of batch 10 = 80 rows (each reward used ~4 times): accounted as 20 releases.
    pipeline, config = _pipeline_config(tmp_path / "run", dataset=str(path), methods=["input_perturbation"],
                                        epsilons=[2.0], samples=80, batch_size=10)
    pipeline.run(config)
    run = json.loads((tmp_path / "run" / "curator" / "results.json").read_text())["runs"][0]
    assert run["privacy"]["n_rewards"] == 20 and run["steps"] == 8
    # Calibrated by the ledger's own analysis (pld here) as one Gaussian release, std = z sqrt(N).
    assert run["privacy"]["reward_noise_std"] == pytest.approx(gaussian_noise_multiplier(2.0, 1e-4, 1, "pld") * math.sqrt(20))
    event = run["ledger"]["stages"][0]["events"]
    assert event == [[{"type": "PoissonGaussianEvent", "noise_multiplier": pytest.approx(
        run["privacy"]["reward_noise_std"] / math.sqrt(20)), "sample_rate": 1.0}, 1]]


# ----------------------------------------------------------------------------- rewards: clamped, not refused
def test_rewards_outside_the_declared_range_are_clamped_and_counted_never_refused():
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    class NanLine(LineEnv):
        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            return obs, (float("nan") if self.t == 3 else reward), terminated, truncated, info

    learner = _sound_learner(hidden_sizes=[4])
    # NaN has no neighbour under sup |r - r'| <= 1 (RewardClamp's docstring): refused, with or without a range.
    for reward_range in (None, (0.0, 1.0)):
        with pytest.raises(ValidationError, match="rewards"):
            EnvInteractionSource(NanLine(), learner.act, 8, reward_range=reward_range).sample(
                torch.Generator().manual_seed(0))
    # The line's rewards lie in [0, 0.5]: a declared range of [0, 0.2] clamps every larger one, and the run goes on.
    # Rewards never steer the transitions (actions come from the network), so both sources see the same ones.
    wide = EnvInteractionSource(LineEnv(), learner.act, 64, reward_range=(0.0, 0.5))
    narrow_clamp = RewardClamp((0.0, 0.2))
    narrow = EnvInteractionSource(LineEnv(), learner.act, 64, reward_range=narrow_clamp)
    raw = wide.sample(torch.Generator().manual_seed(0)).data["rewards"]
    clamped = narrow.sample(torch.Generator().manual_seed(0)).data["rewards"]
    assert wide.reward_clamp.clamped == 0 and int((raw > 0.2).sum()) > 0
    torch.testing.assert_close(clamped, raw.clamp(0.0, 0.2))
    assert narrow_clamp.clamped == int((raw > 0.2).sum())
    episodes = [{"observations": np.zeros((3, 1), np.float32), "actions": np.array([0, 1]),
                 "rewards": np.array([0.1, 7.0], np.float32), "terminated": True, "truncated": False, "unit_id": 0}]
    dataset = TrajectoryDataset.from_episodes(episodes, DatasetMetadata("line", 2, 1, (1,)))
    offline_clamp = RewardClamp((0.0, 1.0))
    source = dataset_source(dataset, 4, reward_range=offline_clamp)
    assert offline_clamp.clamped == 1 and sorted(source.data["rewards"].tolist()) == pytest.approx([0.1, 1.0])
    assert dataset_source(dataset, 4).n_rows == 2
    with pytest.raises(PrivacyBudgetError, match="n_rewards"):
        dataset_source(dataset, 4, GaussianRewardNoise(1.0, NoiseSource(0), n_rewards=1))


def test_mechanism_settings_are_refused_when_they_void_the_bound():
    with pytest.raises(ValidationError, match="td_clip"):
        FNQConfig(td_clip=2.0)  # weights |w| <= 1 are what bounds each transition's contribution by G
    with pytest.raises(ValidationError, match="td_clip"):
        FNQConfig(td_clip=0.0)
    with pytest.raises(ValidationError, match="reward_scale"):
        FNQConfig(reward_scale=-1.0)
    with pytest.raises(ValidationError, match="update_sensitivity"):
        RewardLevelSource(type("Inner", (), {"batch_size": 4})(), sensitivity=0.0)
    with pytest.raises(ValidationError, match="noise_multiplier"):
        from dporl.privacy.functional_calibration import update_event

        update_event(0.0)
    with pytest.raises(ValidationError, match="batch_size"):  # a fixed, public batch size: the engine divides by it
        source = RewardLevelSource(type("Inner", (), {"batch_size": 4, "sample": lambda self, g: Batch(
            {"x": torch.zeros(3)}, torch.arange(3), 3, False)})(), sensitivity=1.0)
        source.sample(torch.Generator())
    with pytest.raises(ValidationError, match="input_perturbation.n_rewards"):
        GaussianRewardNoise(1.0, NoiseSource(0), n_rewards=0)


def test_released_file_is_loaded_weights_only(tmp_path):
    import pickle

    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    path = tmp_path / "released.pt"
    torch.save({"spec": Payload(), "state_dict": {}, "metadata": {}}, path)  # a pickle that would run code
    with pytest.raises(ValidationError, match="released"):
        load_noisy_q(path)
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValidationError, match="released"):
        load_noisy_q(path)


def test_any_torch_q_network_works_through_the_opacus_mode():
    # A network with a non-Linear parameterised layer: bookkeeping refuses it, opacus computes the same clipped,
    # TD-weighted per-transition update as one autograd pass per transition (naive).
    from torch import nn

    from dporl.privacy.dpsgd import DPSGDEngine

    def learner():
        torch.manual_seed(7)
        network = nn.Sequential(nn.Linear(1, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))
        return RewardPrivateQLearning(1, 2, FNQConfig(gamma=0.9, td_clip=0.5), q_network=network)

    batch, _, _ = _neighbour_batches(6, rows=12)
    updates = []
    for mode in ("opacus", "naive"):
        model = learner()
        engine = DPSGDEngine(model, max_grad_norm=0.2, noise_multiplier=0.0, expected_batch_size=12,
                             noise=NoiseSource(0), mode=mode)
        losses, weights = model.weighted_row_losses(batch)
        engine.private_backward(losses, batch.unit_index, 12, row_weights=weights)
        updates.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]))
    torch.testing.assert_close(updates[0], updates[1], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValidationError, match="opacus"):
        DPSGDEngine(learner(), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=12, noise=NoiseSource(0))
    with pytest.raises(ValidationError, match="q_network"):  # the released-file format is for dporl's MLPs
        save_noisy_q(Path("/nonexistent/never_written.pt"), learner().function, {})


def test_an_offline_dataset_declaring_other_sizes_than_the_environment_is_refused_before_anything_is_written(tmp_path):
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    episodes = [{"observations": np.zeros((3, 1), np.float32), "actions": np.array([0, 1]),
                 "rewards": np.array([0.1, 0.2], np.float32), "terminated": True, "truncated": False, "unit_id": 0}]
    path = TrajectoryDataset.from_episodes(episodes, DatasetMetadata("line", 3, 1, (1,))).save(tmp_path / "d.npz")
    pipeline, config = _pipeline_config(tmp_path / "run", dataset=str(path), methods=["fnq"], epsilons=[1.0])
    with pytest.raises(ValidationError) as info:
        pipeline.run(config)
    assert info.value.field == "dataset.metadata.n_actions" and not (tmp_path / "run").exists()
