import math

import pytest
import torch

from dporl.algos.gpope import GPOPE, GPOPEConfig, dense_primal_dual_gradients, paper_lemma1_epsilon, primal_dual_gradients
from dporl.algos.lstd import lstd, lstd_solution, td_statistics, td_terms
from dporl.privacy.samplers import Batch
from dporl.utils.validation import ValidationError

GAMMA = 0.9


class LinearFeatures:
    """A fixed random linear feature map (a local fixture: any callable with n_features works)."""

    def __init__(self, obs_dim, n_features, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(obs_dim, n_features, generator=g, dtype=torch.float64)
        self.n_features = n_features

    def __call__(self, obs):
        return torch.cos(obs.double() @ self.weight)


class OneHot:
    def __init__(self, n_states):
        self.n_features = n_states

    def __call__(self, obs):
        return torch.nn.functional.one_hot(obs[..., 0].long(), self.n_features).double()


def uniform_policy(n_actions):
    return lambda obs: torch.full((*obs.shape[:-1], n_actions), 1.0 / n_actions, dtype=torch.float64)


def random_trajectories(n=6, obs_dim=3, n_actions=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (n,), generator=g)
    horizon = int(lengths.max())
    mask = torch.arange(horizon).unsqueeze(0) < lengths.unsqueeze(1)
    return {
        "observations": torch.randn(n, horizon + 1, obs_dim, generator=g),
        "actions": torch.randint(0, n_actions, (n, horizon), generator=g) * mask,
        "rewards": torch.randn(n, horizon, generator=g) * mask,
        "behavior_log_probs": torch.log(torch.rand(n, horizon, generator=g) * 0.8 + 0.1) * mask,
        "mask": mask,
        "terminated": torch.rand(n, generator=g) < 0.5,
        "lengths": lengths,
    }


def loop_reference(features, data, theta, w, gamma, target_probs):
    """B_i straight from Xie et al. 2019's Algorithm 1, one trajectory and one transition at a time (independent of
    td_terms).

    ``target_probs``: pi(a|s) of a uniform target (the same for every action), or None on-policy.
    """
    out = []
    for i in range(data["mask"].shape[0]):
        tau = int(data["lengths"][i])
        n = theta.shape[0]
        A, C, b = torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for t in range(tau):
            phi = features(data["observations"][i, t])
            terminal = t == tau - 1 and bool(data["terminated"][i])
            phi_next = torch.zeros(n, dtype=torch.float64) if terminal else features(data["observations"][i, t + 1])
            rho = target_probs / math.exp(float(data["behavior_log_probs"][i, t])) if target_probs else 1.0
            A += rho * torch.outer(phi, phi - gamma * phi_next) / tau
            C += torch.outer(phi, phi) / tau
            b += rho * phi * float(data["rewards"][i, t]) / tau
        out.append(torch.cat([-A.T @ w, A @ theta + C @ w - b]))
    return torch.stack(out)


@pytest.mark.parametrize("off_policy", [False, True])
def test_primal_dual_gradient_matches_dense_and_spec_formula(off_policy):
    data = random_trajectories()
    features = LinearFeatures(3, 5)
    policy = uniform_policy(3) if off_policy else None
    g = torch.Generator().manual_seed(1)
    theta, w = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    terms = td_terms(features, data, policy, dtype=torch.float64)
    fast = primal_dual_gradients(terms, theta, w, GAMMA)
    dense = dense_primal_dual_gradients(terms, theta, w, GAMMA)
    reference = loop_reference(features, data, theta, w, GAMMA, 1.0 / 3 if off_policy else None)
    assert fast.shape == (6, 10)
    torch.testing.assert_close(fast, reference, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dense, reference, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("off_policy", [False, True])
def test_tabular_path_equals_the_dense_gradient(off_policy):
    # One-hot features with state_index take the O(tau) gather/scatter path: same B_i as the reference loop, including
    # terminal and truncated endings, off-policy ratios and a batch padded wider than its longest trajectory.
    from dporl.algos.gpope import tabular_primal_dual_gradients
    from dporl.envs.features import TabularFeatures

    g = torch.Generator().manual_seed(4)
    data = random_trajectories(n=7, obs_dim=1)
    data["observations"] = torch.randint(0, 6, data["observations"].shape, generator=g).float()
    features = TabularFeatures(6)
    policy = uniform_policy(3) if off_policy else None
    theta, w = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    fast = tabular_primal_dual_gradients(features, data, policy, theta, w, GAMMA)
    one_hot = lambda obs: features(obs).double()  # noqa: E731
    reference = loop_reference(one_hot, data, theta, w, GAMMA, 1.0 / 3 if off_policy else None)
    torch.testing.assert_close(fast, reference, rtol=1e-10, atol=1e-10)
    # Through the module: the batch is cut to its longest trajectory first (here padded by 3 extra columns).
    wide = {k: torch.nn.functional.pad(v, (0, 3)) if k in ("actions", "rewards", "mask", "behavior_log_probs")
            else v for k, v in data.items()}
    wide["observations"] = torch.nn.functional.pad(data["observations"], (0, 0, 0, 3))
    module = GPOPE(features, GPOPEConfig(gamma=GAMMA, dtype="float64"), target_policy=policy)
    with torch.no_grad():
        module.theta.copy_(theta)
        module.w.copy_(w)
    directions = module.unit_directions(Batch(wide, torch.arange(7), 7, private=True))
    torch.testing.assert_close(directions, reference, rtol=1e-10, atol=1e-10)


def test_unit_directions_average_rows_of_the_same_unit():
    data = random_trajectories(n=4)
    module = GPOPE(LinearFeatures(3, 5), GPOPEConfig(gamma=GAMMA, dtype="float64"))
    with torch.no_grad():
        module.theta.normal_()
        module.w.normal_()
    unit_index = torch.tensor([0, 1, 1, 2])
    directions = module.unit_directions(Batch(data, unit_index, 3, private=True))
    rows = primal_dual_gradients(module.terms(data), module.theta.detach(), module.w.detach(), GAMMA)
    torch.testing.assert_close(directions[1], (rows[1] + rows[2]) / 2)
    torch.testing.assert_close(directions[2], rows[3])


def test_off_policy_needs_behaviour_probabilities_and_features_need_size():
    data = random_trajectories()
    data.pop("behavior_log_probs")
    with pytest.raises(ValidationError, match="behavior_log_probs"):
        td_terms(LinearFeatures(3, 5), data, uniform_policy(3))
    with pytest.raises(ValidationError, match="features"):
        GPOPE(lambda obs: obs)


def test_terminal_successor_has_zero_features_and_truncation_bootstraps():
    data = random_trajectories()
    terms = td_terms(LinearFeatures(3, 5), data, dtype=torch.float64)
    for i, tau in enumerate(data["lengths"].tolist()):
        last_next = terms.phi_next[i, tau - 1]
        if data["terminated"][i]:
            assert torch.count_nonzero(last_next) == 0
        else:
            torch.testing.assert_close(last_next, LinearFeatures(3, 5)(data["observations"][i, tau]))
        assert torch.count_nonzero(terms.phi[i, tau:]) == 0


def test_wis_lstd_is_the_weighted_importance_sampling_average_in_the_tabular_case():
    # One state, two actions, episodes of one step: V = sum rho r / sum rho (weighted IS), not mean(rho r).
    data = {
        "observations": torch.zeros(4, 2, 1),
        "actions": torch.tensor([[0], [1], [1], [0]]),
        "rewards": torch.tensor([[1.0], [3.0], [5.0], [2.0]]),
        "behavior_log_probs": torch.log(torch.tensor([[0.8], [0.2], [0.2], [0.8]])),
        "mask": torch.ones(4, 1, dtype=torch.bool),
        "terminated": torch.ones(4, dtype=torch.bool),
    }
    target = lambda obs: torch.tensor([0.5, 0.5]).expand(*obs.shape[:-1], 2)  # noqa: E731
    rho = torch.tensor([0.5 / 0.8, 0.5 / 0.2, 0.5 / 0.2, 0.5 / 0.8])
    expected = float((rho * torch.tensor([1.0, 3.0, 5.0, 2.0])).sum() / rho.sum())
    theta = lstd(OneHot(1), data, 0.9, target_policy=target)
    assert float(theta[0]) == pytest.approx(expected, rel=1e-6)  # logged log-probs are float32


def test_paper_lemma1_epsilon_matches_its_formula():
    sigma, m, steps, delta = 2.0, 1000, 5000, 1e-5
    factor = min(4 * (math.exp(1 / sigma**2) - 1), 2 * math.exp(1 / sigma**2))
    best = min((steps * lam * (lam + 1) / (2 * m**2) * factor + math.log(1 / delta)) / lam for lam in range(1, 4097))
    assert paper_lemma1_epsilon(sigma, m, steps, delta) == pytest.approx(best, rel=1e-12)
    assert paper_lemma1_epsilon(4.0, m, steps, delta) < paper_lemma1_epsilon(sigma, m, steps, delta)
    assert paper_lemma1_epsilon(sigma, m, 2 * steps, delta) > paper_lemma1_epsilon(sigma, m, steps, delta)


# ----------------------------------------------------------------------------------------------- via the Trainer
from dporl.privacy.accountants import epsilon_for  # noqa: E402
from dporl.privacy.events import PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent  # noqa: E402
from dporl.privacy.ledger import PrivacyLedger  # noqa: E402
from dporl.privacy.samplers import FixedSizeSource, PoissonUnitSource  # noqa: E402
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig  # noqa: E402
from dporl.train.trainer import Trainer  # noqa: E402


def tabular_trajectories(n=40, n_states=5, seed=0):
    """Random walks on a small state space (integer states as 1-d observations), every state visited."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 8, (n,), generator=g)
    horizon = int(lengths.max())
    mask = torch.arange(horizon).unsqueeze(0) < lengths.unsqueeze(1)
    states = torch.randint(0, n_states, (n, horizon + 1), generator=g).float()
    return {
        "observations": states.unsqueeze(-1),
        "actions": torch.zeros(n, horizon, dtype=torch.long),
        "rewards": torch.rand(n, horizon, generator=g) * mask,
        "mask": mask,
        "terminated": torch.rand(n, generator=g) < 0.7,
    }


class FullBatchSource:
    """Every trajectory every step, as a public (noiseless) batch: deterministic GTD2 for the convergence test."""

    def __init__(self, data):
        self.data = data
        self.n = data["mask"].shape[0]
        self.expected_batch_size = float(self.n)

    def sample(self, generator):
        return Batch(dict(self.data), torch.arange(self.n), self.n, private=False)

    def step_event(self, noise_multiplier):
        return None


def _trainer(module, source, tmp_path, steps, dp=None, lr=0.5, ledger=None):
    config = TrainerConfig(
        max_steps=steps, eval_every=steps, checkpoint_every=steps, log_every=steps, progress=False,
        optimizer=OptimizerConfig(name="sgd", lr=lr),
    )
    ledger = ledger or PrivacyLedger()
    return Trainer(module, source, config=config, dp=dp, ledger=ledger, run_dir=tmp_path, pipeline="ope",
                   pipeline_config={"test": True}), ledger


def test_noiseless_gpope_converges_to_the_td_fixed_point(tmp_path):
    data = tabular_trajectories()
    features = OneHot(5)
    module = GPOPE(features, GPOPEConfig(gamma=GAMMA, dtype="float64"))
    trainer, _ = _trainer(module, FullBatchSource(data), tmp_path, steps=3000, lr=2.0)
    trainer.fit()
    stats = td_statistics(td_terms(features, data, dtype=torch.float64), GAMMA, weighting="trajectory")
    fixed_point = lstd_solution(stats)
    # Full-batch GTD2 is a linear iteration contracting to the saddle point (A theta = b, w = 0); after 3000
    # steps the remaining error is far below the tolerance (the contraction factor is < 0.995 here).
    torch.testing.assert_close(module.theta.detach(), fixed_point, atol=1e-6, rtol=0)
    torch.testing.assert_close(module.w.detach(), torch.zeros(5, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", ["poisson", "paper"])
def test_private_gpope_ledger_matches_the_accountant(tmp_path, mode):
    data = tabular_trajectories(n=50)
    units = torch.arange(50)
    if mode == "poisson":
        source = PoissonUnitSource(data, units, 50, sample_rate=0.04)
        event = PoissonGaussianEvent(1.5, 0.04)
    else:
        source = FixedSizeSource(data, units, 50, sample_size=1)
        event = SampledWithoutReplacementGaussianEvent(1.5 / 2, 1, 50)  # replace-one: sensitivity 2h
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(5.0, 1e-5), mechanism="rdp", unit="trajectory")
    module = GPOPE(OneHot(5), GPOPEConfig(gamma=GAMMA))
    # closed-form directions need no per-layer tape: "naive" is the engine mode without hooks
    dp = DPConfig(epsilon=5.0, delta=1e-5, noise_multiplier=1.5, max_grad_norm=1.0, noise_seed=0, clipping="naive")
    trainer, ledger = _trainer(module, source, tmp_path, steps=40, dp=dp, lr=0.1, ledger=ledger)
    result = trainer.fit()
    assert result.steps == 40
    assert ledger.stages["train"].unit.name == "trajectory"
    assert ledger.spent("train") == pytest.approx(epsilon_for([(event, 40)], 1e-5, "rdp"), rel=1e-12)
    assert torch.isfinite(module.theta).all() and module.theta.abs().sum() > 0


def test_feature_and_policy_networks_are_frozen():
    features = torch.nn.Sequential(torch.nn.Linear(3, 4))
    features.n_features = 4
    policy = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Softmax(-1))
    module = GPOPE(features, target_policy=policy)
    assert [name for name, p in module.named_parameters() if p.requires_grad] == ["theta", "w"]


def test_iterate_averaging_is_post_processing(tmp_path):
    # Same data, same secret seeds, with and without tail averaging: the ledgers must hold the same events (averaging
    # releases nothing new: every iterate is already a released mechanism), the iterates must be identical, and
    # the averaged estimate must be the plain mean of the iterates after average_from (recorded by an evaluator
    # that runs after every step).
    data = tabular_trajectories(n=50)
    histories, iterates, modules = [], [], []
    for k, average_from in enumerate((None, 20)):
        source = PoissonUnitSource(data, torch.arange(50), 50, sample_rate=0.04)
        module = GPOPE(OneHot(5), GPOPEConfig(gamma=GAMMA, average_from=average_from))
        seen = []
        dp = DPConfig(epsilon=5.0, delta=1e-5, noise_multiplier=1.5, max_grad_norm=1.0, noise_seed=3, clipping="naive")
        config = TrainerConfig(max_steps=40, eval_every=1, checkpoint_every=40, log_every=40, progress=False,
                               optimizer=OptimizerConfig(name="sgd", lr=0.1))
        trainer = Trainer(module, source, config=config, dp=dp, ledger=PrivacyLedger(), run_dir=tmp_path / str(k),
                          pipeline="ope", pipeline_config={"test": True},
                          evaluators={"iterate": lambda mod: seen.append(mod.theta.detach().clone()) or {}})
        trainer.fit()
        histories.append(list(trainer.ledger.stages["train"].accountant.history))
        iterates.append(torch.stack(seen))
        modules.append(module)
    assert histories[0] == histories[1] and sum(count for _, count in histories[0]) == 40
    torch.testing.assert_close(iterates[0], iterates[1], rtol=0, atol=0)
    last, averaged = modules
    torch.testing.assert_close(last.estimate(), iterates[0][-1], rtol=0, atol=0)
    expected = iterates[1][20:].double().mean(0).float()
    torch.testing.assert_close(averaged.estimate(), expected, rtol=1e-6, atol=1e-7)
    assert int(averaged.n_averaged) == 20
    assert not torch.allclose(averaged.estimate(), last.estimate())  # the noisy last iterate is not the average


@pytest.mark.parametrize("weighting", ["trajectory", "transition"])
def test_chunked_statistics_equal_the_one_shot_ones(weighting):
    from dporl.algos.lstd import sample_td_statistics

    data = random_trajectories(n=11)
    features = LinearFeatures(3, 5)
    whole = td_statistics(td_terms(features, data, uniform_policy(3), dtype=torch.float64), GAMMA, weighting)
    chunked = sample_td_statistics(features, data, GAMMA, target_policy=uniform_policy(3), weighting=weighting,
                                   chunk=4)
    for name in ("A", "b", "C"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), rtol=1e-12, atol=1e-14)
