import math

import pytest
import torch
from torch import nn

from dporl.experts import ExpertSet, StackedLinearPolicy, StackedMLPPolicy
from dporl.experts.expert_set import sample_from_log_probs
from dporl.utils.validation import ValidationError

OBS_DIM, N_ACTIONS = 4, 3


def _single_mlps(count, seed=0, hidden=(8, 5), activation=nn.Tanh):
    torch.manual_seed(seed)
    modules = []
    for _ in range(count):
        layers, width = [], OBS_DIM
        for h in hidden:
            layers += [nn.Linear(width, h), activation()]
            width = h
        layers.append(nn.Linear(width, N_ACTIONS))
        modules.append(nn.Sequential(*layers))
    return modules


def _states(batch, seed=1, leading=()):
    return torch.randn(*leading, batch, OBS_DIM, generator=torch.Generator().manual_seed(seed))


def _reference_log_probs(logits, softening, p_min):
    """Per-row reference written independently of ExpertSet: a plain probability table, logged at the end."""
    if softening == "none":
        return torch.log_softmax(logits, -1)
    probs = torch.full_like(logits, p_min)
    for index in range(logits.shape[0]):
        best = max(range(N_ACTIONS), key=lambda a: (logits[index, a].item(), -a))  # first maximum wins ties
        probs[index, best] = 1 - (N_ACTIONS - 1) * p_min
    return probs.log()


@pytest.mark.parametrize("softening,p_min", [("argmax", 0.05), ("none", None)])
@pytest.mark.parametrize("family", ["mlp", "linear"])
def test_batched_outputs_equal_per_expert_loop(family, softening, p_min):
    if family == "mlp":
        modules = _single_mlps(6)
        policy = StackedMLPPolicy.from_single(modules)
    else:
        torch.manual_seed(3)
        modules = [nn.Linear(OBS_DIM, N_ACTIONS) for _ in range(6)]
        policy = StackedLinearPolicy.from_single(modules)
    experts = ExpertSet(policy, p_min, softening)
    shared = _states(17)
    paired = _states(9, seed=2, leading=(6,))
    actions = torch.randint(0, N_ACTIONS, (17,), generator=torch.Generator().manual_seed(4))

    all_out = experts.log_probs(shared)
    paired_out = experts.log_probs_paired(paired)
    chosen = experts.log_prob_of(shared, actions)
    assert all_out.shape == (6, 17, N_ACTIONS) and paired_out.shape == (6, 9, N_ACTIONS) and chosen.shape == (6, 17)
    with torch.no_grad():
        for i, module in enumerate(modules):
            expected = _reference_log_probs(module(shared), softening, p_min)
            torch.testing.assert_close(all_out[i], expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(chosen[i], expected[torch.arange(17), actions], rtol=1e-5, atol=1e-5)
            expected_paired = _reference_log_probs(module(paired[i]), softening, p_min)
            torch.testing.assert_close(paired_out[i], expected_paired, rtol=1e-5, atol=1e-5)


def test_argmax_softening_masses_are_exact_and_ties_go_to_lowest_action():
    p_min = 0.1
    weight = torch.zeros(2, OBS_DIM, N_ACTIONS)
    bias = torch.tensor([[0.0, 2.0, 2.0], [1.0, 1.0, 1.0]])  # expert 0 ties actions 1 and 2, expert 1 ties all
    experts = ExpertSet(StackedLinearPolicy.from_weights(weight, bias), p_min, "argmax")
    probs = experts.log_probs(_states(5)).exp().double()
    best = 1 - (N_ACTIONS - 1) * p_min
    torch.testing.assert_close(probs[0], torch.tensor([p_min, best, p_min]).double().expand(5, -1))
    torch.testing.assert_close(probs[1], torch.tensor([best, p_min, p_min]).double().expand(5, -1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    assert probs.min() >= p_min * (1 - 1e-6)


def test_none_softening_checks_p_min_on_every_query():
    weight = torch.zeros(1, OBS_DIM, N_ACTIONS)
    weight[0, 0] = torch.tensor([3.0, 0.0, 0.0])  # logits depend on s_0: extreme states break any p_min
    experts = ExpertSet(StackedLinearPolicy.from_weights(weight, torch.zeros(1, N_ACTIONS)), 0.1, "none")
    calm = torch.zeros(4, OBS_DIM)
    assert experts.log_probs(calm).exp().min() == pytest.approx(1 / 3, rel=1e-5)
    extreme = calm.clone()
    extreme[2, 0] = 5.0  # softmax(15, 0, 0): the two other actions get ~3e-7 < 0.1
    with pytest.raises(ValidationError) as info:
        experts.log_probs(extreme)
    assert info.value.field == "expert_set.p_min" and "state 2" in str(info.value)
    with pytest.raises(ValidationError):
        experts.log_probs_paired(extreme.unsqueeze(0))
    with pytest.raises(ValidationError):
        experts.sample(extreme.unsqueeze(0), torch.Generator().manual_seed(0))
    # Without a p_min the raw softmax is returned unchecked.
    unchecked = ExpertSet(experts.policy, None, "none").log_probs(extreme)
    assert unchecked.exp()[0, 2, 1] < 1e-6


@pytest.mark.parametrize(
    "p_min,softening",
    [(0.0, "argmax"), (-0.1, "argmax"), (1 / 3, "argmax"), (0.5, "none"), (None, "argmax"), (float("nan"), "none"),
     (True, "argmax")],
)
def test_invalid_p_min_is_rejected(p_min, softening):
    policy = StackedLinearPolicy(2, OBS_DIM, N_ACTIONS)
    with pytest.raises(ValidationError) as info:
        ExpertSet(policy, p_min, softening)
    assert info.value.field == "expert_set.p_min"


def test_invalid_softening_and_states_are_rejected():
    policy = StackedLinearPolicy(2, OBS_DIM, N_ACTIONS)
    with pytest.raises(ValidationError):
        ExpertSet(policy, 0.1, "clip")
    experts = ExpertSet(policy, 0.1)
    with pytest.raises(ValidationError, match="states"):
        experts.log_probs(torch.zeros(3, OBS_DIM + 1))
    with pytest.raises(ValidationError, match="states"):
        experts.log_probs_paired(torch.zeros(3, OBS_DIM))
    with pytest.raises(ValidationError, match="actions"):
        experts.log_prob_of(torch.zeros(3, OBS_DIM), torch.tensor([0, 1, N_ACTIONS]))


def test_expert_chunks_match_the_full_query():
    experts = ExpertSet(StackedMLPPolicy.from_single(_single_mlps(7, seed=5)), 0.02)
    states = _states(11)
    full = experts.log_probs(states)
    torch.testing.assert_close(experts.log_probs(states, experts=slice(2, 5)), full[2:5])
    index = torch.tensor([6, 0, 3, 3])
    torch.testing.assert_close(experts.log_probs(states, experts=index), full[index])
    torch.testing.assert_close(experts.log_prob_of(states, torch.zeros(11, dtype=torch.long), experts=[1, 4]),
                               full[[1, 4], :, 0])
    paired = _states(5, seed=6, leading=(7,))
    torch.testing.assert_close(experts.log_probs_paired(paired[2:5], experts=slice(2, 5)),
                               experts.log_probs_paired(paired)[2:5])
    subset = experts.select([4, 1])
    assert subset.n_experts == 2 and subset.p_min == experts.p_min
    torch.testing.assert_close(subset.log_probs(states), full[[4, 1]])


def test_sample_frequencies_match_softened_probabilities():
    p_min, n = 0.05, 20000
    experts = ExpertSet(StackedMLPPolicy.from_single(_single_mlps(3, seed=7)), p_min, "argmax")
    one_state = _states(1, seed=8)
    states = one_state.expand(3, n, OBS_DIM)
    actions = experts.sample(states, torch.Generator().manual_seed(9))
    assert actions.shape == (3, n) and actions.dtype == torch.long
    probs = experts.log_probs(one_state)[:, 0].exp()
    for i in range(3):
        counts = torch.bincount(actions[i], minlength=N_ACTIONS).double()
        # Each count is Binomial(n, p): 4.5 standard deviations keeps the false-alarm rate below 1e-5 per cell.
        tolerance = 4.5 * torch.sqrt(n * probs[i] * (1 - probs[i])).double()
        assert torch.all((counts - n * probs[i]).abs() <= tolerance), (counts, n * probs[i])
    # Same generator seed, same actions.
    again = experts.sample(states, torch.Generator().manual_seed(9))
    assert torch.equal(actions, again)


def test_inverse_cdf_sampler_never_returns_an_impossible_action():
    log_probs = torch.log(torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]))
    actions = sample_from_log_probs(log_probs.expand(5000, 2, 3), torch.Generator().manual_seed(0))
    assert (actions[:, 0] == 1).all() and (actions[:, 1] < 2).all()


def test_save_load_round_trip(tmp_path):
    info = {"source": "test", "per_expert": {"return": [1.0, 2.0, 3.0]}}
    experts = ExpertSet(StackedMLPPolicy.from_single(_single_mlps(3, seed=10, activation=nn.ReLU)), 0.1, info=info)
    path = experts.save(tmp_path / "experts.pt")
    loaded = ExpertSet.load(path)
    states = _states(13)
    torch.testing.assert_close(loaded.log_probs(states), experts.log_probs(states))
    assert loaded.policy.activation == "relu" and loaded.info == info
    reference = loaded.reference()
    assert reference == experts.reference()
    assert reference["sha256"] == experts.fingerprint() and reference["path"] == str(path)
    assert loaded.select([2, 0]).info["per_expert"]["return"] == [3.0, 1.0]
    # A different p_min is a different expert set.
    assert ExpertSet(experts.policy, 0.05).fingerprint() != experts.fingerprint()


def test_load_rejects_bad_files(tmp_path):
    bad = tmp_path / "junk.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ValidationError):
        ExpertSet.load(bad)
    with pytest.raises(ValidationError, match="not found"):
        ExpertSet.load(tmp_path / "missing.pt")
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(ValidationError, match="format"):
        ExpertSet.load(tmp_path / "other.pt")
    experts = ExpertSet(StackedLinearPolicy(2, OBS_DIM, N_ACTIONS), 0.1)
    path = experts.save(tmp_path / "ok.pt")
    payload = torch.load(path, weights_only=True)
    payload["state_dict"]["weight"][0, 0, 0] = math.nan
    torch.save(payload, tmp_path / "nan.pt")
    with pytest.raises(ValidationError, match="NaN"):
        ExpertSet.load(tmp_path / "nan.pt")
    payload["state_dict"]["weight"] = torch.zeros(2, OBS_DIM + 1, N_ACTIONS)
    torch.save(payload, tmp_path / "shape.pt")
    with pytest.raises(ValidationError, match="state_dict"):
        ExpertSet.load(tmp_path / "shape.pt")


@pytest.mark.parametrize("softening,p_min", [("argmax", 0.1), ("none", None)])
def test_in_place_softening_never_touches_parameters_or_inputs(softening, p_min):
    # Softening overwrites the freshly computed logits in place; parameters and the caller's states must survive.
    for policy in (StackedMLPPolicy.from_single(_single_mlps(3, seed=11)), StackedLinearPolicy.from_weights(
            torch.randn(3, OBS_DIM, N_ACTIONS), torch.randn(3, N_ACTIONS))):
        experts = ExpertSet(policy, p_min, softening)
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        states = _states(8)
        states_copy = states.clone()
        first = experts.log_probs(states)
        experts.log_probs_paired(states.expand(3, -1, -1))
        experts.log_prob_of(states, torch.zeros(8, dtype=torch.long))
        torch.testing.assert_close(experts.log_probs(states), first)
        assert torch.equal(states, states_copy)
        for name, value in policy.state_dict().items():
            assert torch.equal(value, before[name]), name
