import math

import pytest
import torch

from dporl.privacy.events import MixtureEvent, PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent
from dporl.privacy.samplers import FixedSizeSource, MixtureSource, PoissonUnitSource, UniformBatchSource
from dporl.utils.validation import ValidationError


def _expert_rows(n_units=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (n_units,), generator=g)  # some units own no rows
    unit_of_row = torch.repeat_interleave(torch.arange(n_units), counts)
    perm = torch.randperm(len(unit_of_row), generator=g)  # rows not grouped by unit on input
    unit_of_row = unit_of_row[perm]
    data = {"row_id": torch.arange(len(unit_of_row)), "unit": unit_of_row}
    return data, unit_of_row, counts


def test_poisson_inclusion_frequency_matches_rate():
    data, unit_of_row, _ = _expert_rows()
    q, steps = 0.2, 2000
    source = PoissonUnitSource(data, unit_of_row, 50, q, rows_per_unit=2)
    g = torch.Generator().manual_seed(1)
    sampled_units = 0
    for _ in range(steps):
        sampled_units += source.sample(g).n_units
    # n_units per step ~ Binomial(50, q): the total over steps has sd sqrt(steps * 50 q (1 - q)).
    expected = steps * 50 * q
    assert abs(sampled_units - expected) < 4 * math.sqrt(steps * 50 * q * (1 - q))
    assert source.expected_batch_size == pytest.approx(10.0)


def test_rows_come_only_from_their_sampled_unit_and_respect_rows_per_unit():
    data, unit_of_row, counts = _expert_rows(seed=2)
    source = PoissonUnitSource(data, unit_of_row, 50, 0.5, rows_per_unit=3)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        batch = source.sample(g)
        assert batch.private
        if batch.n_rows:
            assert int(batch.unit_index.max()) < batch.n_units
        units_of_rows = batch.data["unit"]
        # all rows sharing a unit_index share one original unit, and each unit with rows contributes exactly 3
        for position in batch.unit_index.unique():
            owners = units_of_rows[batch.unit_index == position]
            assert len(owners.unique()) == 1 and len(owners) == 3
        distinct = units_of_rows.unique()
        assert len(distinct) == len(batch.unit_index.unique())
        assert (counts[distinct] > 0).all()


def test_all_rows_mode_takes_every_row_of_each_sampled_unit():
    data, unit_of_row, counts = _expert_rows(seed=4)
    source = PoissonUnitSource(data, unit_of_row, 50, 0.3, rows_per_unit=None)
    batch = source.sample(torch.Generator().manual_seed(5))
    taken = batch.data["unit"]
    for unit in taken.unique():
        assert int((taken == unit).sum()) == int(counts[unit])
    assert sorted(batch.data["row_id"].tolist()) == sorted(set(batch.data["row_id"].tolist()))


def test_events_describe_the_sampling():
    data, unit_of_row, _ = _expert_rows()
    private = PoissonUnitSource(data, unit_of_row, 50, 0.1)
    public = UniformBatchSource({"x": torch.arange(10)}, batch_size=4)
    assert private.step_event(2.0) == PoissonGaussianEvent(2.0, 0.1)
    assert public.step_event(2.0) is None
    assert MixtureSource(0.25, private, public).step_event(2.0) == MixtureEvent(0.25, PoissonGaussianEvent(2.0, 0.1))
    assert MixtureSource(1.0, private, public).step_event(2.0) == PoissonGaussianEvent(2.0, 0.1)
    assert MixtureSource(0.0, private, public).step_event(2.0) is None
    fixed = FixedSizeSource(data, unit_of_row, 50, 1)
    assert fixed.step_event(4.0) == SampledWithoutReplacementGaussianEvent(2.0, 1, 50)


def test_mixture_branch_frequency():
    data, unit_of_row, _ = _expert_rows()
    mix = MixtureSource(0.3, PoissonUnitSource(data, unit_of_row, 50, 0.1), UniformBatchSource({"row_id": torch.arange(5), "unit": torch.zeros(5, dtype=torch.long)}, 4))
    g = torch.Generator().manual_seed(6)
    private = sum(mix.sample(g).private for _ in range(3000))
    assert abs(private - 900) < 4 * math.sqrt(3000 * 0.3 * 0.7)


def test_fixed_size_source_samples_distinct_units_uniformly():
    data = {"x": torch.arange(10)}
    source = FixedSizeSource(data, torch.arange(10), 10, 3)
    g = torch.Generator().manual_seed(7)
    hits = torch.zeros(10)
    for _ in range(3000):
        batch = source.sample(g)
        assert len(batch.data["x"].unique()) == 3 and batch.n_units == 3
        hits[batch.data["x"]] += 1
    # each unit is included with probability 3/10: count ~ Binomial(3000, 0.3)
    assert (hits - 900).abs().max() < 4 * math.sqrt(3000 * 0.3 * 0.7)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: PoissonUnitSource({"x": torch.zeros(3)}, torch.tensor([0, 1, 5]), 3, 0.1), "unit_of_row"),
        (lambda: PoissonUnitSource({"x": torch.zeros(3)}, torch.tensor([0, 1, 2]), 3, 0.0), "sample_rate"),
        (lambda: PoissonUnitSource({"x": torch.zeros(3)}, torch.tensor([0, 1, 2]), 3, 1.5), "sample_rate"),
        (lambda: PoissonUnitSource({"x": torch.zeros(3), "y": torch.zeros(2)}, torch.tensor([0, 1, 2]), 3, 0.1), "data"),
        (lambda: PoissonUnitSource({"x": torch.zeros(3)}, torch.tensor([0, 1]), 3, 0.1), "unit_of_row"),
        (lambda: PoissonUnitSource({"x": torch.zeros(3)}, torch.tensor([0, 1, 2]), 3, 0.1, rows_per_unit=0), "rows_per_unit"),
        (lambda: UniformBatchSource({"x": torch.zeros(0)}, 4), "data"),
        (lambda: FixedSizeSource({"x": torch.zeros(3)}, torch.tensor([0, 1, 2]), 3, 4), "sample_size"),
    ],
)
def test_bad_inputs_name_their_field(build, field):
    with pytest.raises(ValidationError) as info:
        build()
    assert info.value.field == field


# ---------------------------------------------------------------------------------------------------------------
# Poisson sampling by geometric gaps, the unit index built from runs: statistics with fixed seeds, tolerances from
# the binomial laws (each bound fails with probability <= 1e-6 under the null, Bonferroni over what is tested).
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from dporl.privacy.samplers import UnitRuns, _UnitIndex, poisson_subset  # noqa: E402

LEVEL = 1e-6


def _binomial_bounds(n, p, tests):
    """Two-sided [lo, hi] holding a Binomial(n, p) count with probability >= 1 - LEVEL / tests."""
    tail = LEVEL / (2 * tests)
    return stats.binom.ppf(tail, n, p), stats.binom.isf(tail, n, p)


def _chi_square_fits(observed, expected, dof_extra=0):
    """Pearson chi-square of counts against expected counts, tail bins pooled to expected >= 5; True if the
    statistic stays below the (1 - LEVEL) quantile."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] < 5:  # the pooled tail is too small on its own: merge it into the smallest kept bin
        j = int(np.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return statistic, float(stats.chi2.isf(LEVEL, len(obs) - 1 - dof_extra))


def _inclusions(m, q, steps, seed, chunk=None):
    g = torch.Generator().manual_seed(seed)
    included = torch.zeros(steps, m, dtype=torch.bool)
    for t in range(steps):
        chosen = poisson_subset(m, q, g, chunk=chunk)
        assert torch.all(chosen[1:] > chosen[:-1]) and (len(chosen) == 0 or 0 <= int(chosen[0]) <= int(chosen[-1]) < m)
        included[t, chosen] = True
    return included


@pytest.mark.parametrize("chunk", [None, 1, 7])  # None: the default chunk; 1 and 7 force the continuation path
def test_poisson_subset_is_independent_bernoulli_inclusion(chunk):
    m, q, steps = 200, 0.1, 20_000 if chunk is None else 5_000
    x = _inclusions(m, q, steps, seed=11, chunk=chunk)
    # 1. Each unit's inclusion count ~ Binomial(steps, q) (Bonferroni over the m units).
    lo, hi = _binomial_bounds(steps, q, m)
    hits = x.sum(0).numpy()
    assert lo <= hits.min() and hits.max() <= hi, (hits.min(), hits.max(), lo, hi)
    # 2. Pairwise joint inclusion ~ Binomial(steps, q^2) for every pair (Bonferroni over m (m - 1) / 2 pairs)...
    xf = x.double()
    joint = (xf.T @ xf).numpy()[np.triu_indices(m, 1)]
    lo, hi = _binomial_bounds(steps, q * q, m * (m - 1) // 2)
    assert lo <= joint.min() and joint.max() <= hi, (joint.min(), joint.max(), lo, hi)
    # ... and, far more sensitive to a correlation between neighbours (what a wrong gap law would create), the
    # sum over i of X_i X_{i+d} at lags d = 1..10: mean steps (m - d) q^2; per step, pairs (i, i+d) and (i+d, i+2d)
    # share a unit, so Var = (m - d)(q^2 - q^4) + 2 (m - 2d)(q^3 - q^4). Normal bound at 1e-6 / 10 two-sided.
    z = stats.norm.isf(LEVEL / 20)
    for d in range(1, 11):
        lagged = float((xf[:, :-d] * xf[:, d:]).sum())
        mean = steps * (m - d) * q**2
        sd = math.sqrt(steps * ((m - d) * (q**2 - q**4) + 2 * (m - 2 * d) * (q**3 - q**4)))
        assert abs(lagged - mean) <= z * sd, (d, lagged, mean, sd)
    # 3. The number sampled per step ~ Binomial(m, q): chi-square goodness of fit.
    sizes = np.bincount(x.sum(1).numpy(), minlength=m + 1)
    statistic, threshold = _chi_square_fits(sizes, steps * stats.binom.pmf(np.arange(m + 1), m, q))
    assert statistic <= threshold, (statistic, threshold)


def test_poisson_subset_at_a_million_units_is_binomial_and_uniform_over_units():
    m, q, steps = 1_000_000, 256 / 1_000_000, 2_000
    g = torch.Generator().manual_seed(12)
    sizes, positions = [], []
    for _ in range(steps):
        chosen = poisson_subset(m, q, g)
        sizes.append(len(chosen))
        positions.append(chosen)
    sizes = np.array(sizes)
    support = np.arange(sizes.max() + 50)
    statistic, threshold = _chi_square_fits(np.bincount(sizes, minlength=len(support))[: len(support)],
                                            steps * stats.binom.pmf(support, m, q))
    assert statistic <= threshold, (statistic, threshold)
    # Inclusions spread uniformly over the units: 100 blocks of 10^4 units, each total ~ Binomial(steps 10^4, q).
    blocks = np.bincount(torch.cat(positions).numpy() // 10_000, minlength=100)
    statistic, threshold = _chi_square_fits(blocks, np.full(100, steps * 10_000 * q))
    assert statistic <= threshold, (statistic, threshold)


def test_poisson_subset_edges_and_reproducibility():
    g = torch.Generator().manual_seed(0)
    assert torch.equal(poisson_subset(5, 1.0, g), torch.arange(5))
    assert len(poisson_subset(0, 0.5, g)) == 0
    assert sum(len(poisson_subset(1000, 1e-12, g)) for _ in range(100)) == 0  # expected 1e-7 inclusions in all
    assert len(poisson_subset(10, 1 - 1e-12, g)) == 10
    # A deterministic function of the generator's state: the global torch seed plays no part.
    torch.manual_seed(1)
    first = [poisson_subset(10_000, 0.01, torch.Generator().manual_seed(5)) for _ in range(2)]
    torch.manual_seed(2)
    again = poisson_subset(10_000, 0.01, torch.Generator().manual_seed(5))
    assert torch.equal(first[0], first[1]) and torch.equal(first[0], again)
    assert not torch.equal(first[0], poisson_subset(10_000, 0.01, torch.Generator().manual_seed(6)))
    with pytest.raises(ValidationError) as info:
        poisson_subset(10, 0.5, g, chunk=0)
    assert info.value.field == "chunk"


def _episode_units(seed, n_units=40, n_episodes=60, group=False):
    """Episodes (lengths 1..3) with random units: some units own nothing, some a single one-row episode."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (n_episodes,), generator=g)
    units = torch.randint(0, n_units, (n_episodes,), generator=g)
    if group:  # data logged unit by unit: every unit's rows contiguous
        units = units.sort().values
    return lengths, units, torch.repeat_interleave(units, lengths)


def _argsort_index(unit_of_row, n_units):
    """The grouping the sampler used before runs (reference): a stable argsort of every row's unit."""
    order = torch.argsort(unit_of_row, stable=True)
    counts = torch.bincount(unit_of_row, minlength=n_units)
    return order, counts, torch.cumsum(counts, 0) - counts


@pytest.mark.parametrize("short_runs", [0, 10**9])  # every mode: the search, or a per-row order
@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_unit_index_from_runs_matches_a_stable_argsort_of_the_rows(seed, group, short_runs, monkeypatch):
    monkeypatch.setattr(_UnitIndex, "SHORT_RUNS", short_runs)
    lengths, units, unit_of_row = _episode_units(seed, group=group)
    n_units, n_rows = 40, len(unit_of_row)
    order, counts, offsets = _argsort_index(unit_of_row, n_units)
    assert (counts == 0).any() and (counts == 1).any()
    g = torch.Generator().manual_seed(100 + seed)
    for runs in (unit_of_row, UnitRuns.of_rows(unit_of_row), UnitRuns(lengths, units)):
        index = _UnitIndex(runs, n_units, n_rows)
        sorted_units = bool(torch.all(unit_of_row[1:] >= unit_of_row[:-1]))
        assert index.mode == ("contiguous" if sorted_units else "search" if short_runs == 0 else "order")
        assert torch.equal(index.counts, counts) and torch.equal(index.offsets, offsets)
        owner = torch.repeat_interleave(torch.arange(n_units), counts)
        within = torch.arange(n_rows) - torch.repeat_interleave(offsets, counts)
        assert torch.equal(index.rows_at(owner, within), order)  # the j-th row of unit u, for every (u, j)
        chosen = torch.randperm(n_units, generator=g)[:15]  # in any order (FixedSizeSource passes a permutation)
        rows, position = index.rows_of(chosen, None, g)
        assert torch.equal(rows, torch.cat([order[offsets[u] : offsets[u] + counts[u]] for u in chosen.tolist()]))
        assert torch.equal(position, torch.repeat_interleave(torch.arange(15), counts[chosen]))
        rows, position = index.rows_of(chosen, 2, g)
        assert torch.equal(unit_of_row[rows], chosen[position])
        assert torch.equal(position, torch.nonzero(counts[chosen]).squeeze(1).repeat_interleave(2))


def test_runs_and_rows_give_the_same_batches():
    lengths, units, unit_of_row = _episode_units(7)
    data = {"row": torch.arange(len(unit_of_row))}
    batches = []
    for runs in (unit_of_row, UnitRuns(lengths, units)):
        source = PoissonUnitSource(data, runs, 40, 0.3, rows_per_unit=2)
        g = torch.Generator().manual_seed(8)
        batches.append([source.sample(g) for _ in range(20)])
    for a, b in zip(*batches):
        assert torch.equal(a.data["row"], b.data["row"]) and torch.equal(a.unit_index, b.unit_index)
        assert a.n_units == b.n_units


@pytest.mark.parametrize("unit_of_row, short_runs", [
    ([0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 2, 0, 0], 0),  # unit 0: 7 rows in three runs (binary search)
    ([0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 2, 0, 0], 10**9),  # the same through a per-row order
    ([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2], 0),  # every unit contiguous (direct)
])
def test_rows_within_a_unit_are_uniform(unit_of_row, short_runs, monkeypatch):
    monkeypatch.setattr(_UnitIndex, "SHORT_RUNS", short_runs)
    unit_of_row = torch.tensor(unit_of_row)
    source = PoissonUnitSource({"row": torch.arange(len(unit_of_row))}, unit_of_row, 4, 1.0, rows_per_unit=3)
    g = torch.Generator().manual_seed(9)
    taken = torch.cat([source.sample(g).data["row"] for _ in range(6000)])
    freq = torch.bincount(taken, minlength=len(unit_of_row)).numpy()
    for unit in range(3):
        rows = torch.nonzero(unit_of_row == unit).squeeze(1).numpy()
        assert freq[rows].sum() == 6000 * 3  # every step takes 3 rows of each unit (unit 3 owns none)
        if len(rows) > 1:
            statistic, threshold = _chi_square_fits(freq[rows], np.full(len(rows), 6000 * 3 / len(rows)))
            assert statistic <= threshold, (unit, statistic, threshold)


@pytest.mark.parametrize(
    "runs, field",
    [
        (lambda: UnitRuns(torch.tensor([2, 0]), torch.tensor([0, 1])), "unit_of_row"),
        (lambda: UnitRuns(torch.tensor([2, 1]), torch.tensor([0])), "unit_of_row"),
        (lambda: _UnitIndex(UnitRuns(torch.tensor([2, 1]), torch.tensor([0, 1])), 2, 4), "unit_of_row"),
        (lambda: _UnitIndex(UnitRuns(torch.tensor([2, 1]), torch.tensor([0, 2])), 2, 3), "unit_of_row"),
        (lambda: UnitRuns.of_rows(torch.zeros(2, 2, dtype=torch.long)), "unit_of_row"),
    ],
)
def test_bad_runs_name_their_field(runs, field):
    with pytest.raises(ValidationError) as info:
        runs()
    assert info.value.field == field
