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
