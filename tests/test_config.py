from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dporl.train.config import DPConfig, TrainerConfig
from dporl.utils.config import apply_overrides, dump_config, from_dict, load_config, parse_override, to_dict
from dporl.utils.validation import ValidationError


@dataclass
class Inner:
    size: int = 4
    mode: Literal["a", "b"] = "a"


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    lr: float = 1e-3
    budget: Optional[float] = None
    sizes: list[int] = field(default_factory=lambda: [256, 256])
    name: str = "x"


def test_nested_overrides_and_yaml_scientific_notation():
    cfg = from_dict(Outer, apply_overrides({"inner": {"size": 2}}, ["inner.mode=b", "lr=1e-4", "sizes=[1, 2, 3]"]))
    assert cfg == Outer(inner=Inner(size=2, mode="b"), lr=1e-4, sizes=[1, 2, 3])


@pytest.mark.parametrize(
    "override, field_name",
    [
        ("inner.sise=3", "inner.sise"),
        ("lr=fast", "lr"),
        ("inner.mode=c", "inner.mode"),
        ("inner.size=1.5", "inner.size"),
        ("sizes=[1, x]", "sizes[1]"),
        ("name=3", "name"),
        ("budget=true", "budget"),
    ],
)
def test_bad_values_name_their_field(override, field_name):
    with pytest.raises(ValidationError) as info:
        from_dict(Outer, apply_overrides({}, [override]))
    assert info.value.field == field_name


def test_override_syntax_errors():
    with pytest.raises(ValidationError):
        parse_override("no_equals_sign")
    with pytest.raises(ValidationError):
        parse_override("a..b=1")
    with pytest.raises(ValidationError, match="not a section"):
        apply_overrides({"lr": 1.0}, ["lr.x=2"])


def test_yaml_round_trip(tmp_path):
    cfg = Outer(inner=Inner(size=7, mode="b"), budget=2.5)
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(Outer, path) == cfg
    assert load_config(Outer, path, ["budget=null"]).budget is None


def test_missing_or_invalid_yaml_file(tmp_path):
    with pytest.raises(ValidationError, match="not found"):
        load_config(Outer, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ValidationError, match="not valid YAML"):
        load_config(Outer, bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ValidationError, match="mapping"):
        load_config(Outer, listy)


@pytest.mark.parametrize(
    "overrides, field_name",
    [
        (["epsilon=-1"], "dp.epsilon"),
        (["epsilon=0"], "dp.epsilon"),
        (["epsilon=.nan"], "dp.epsilon"),
        (["epsilon=1", "delta=1"], "dp.delta"),
        (["epsilon=1", "delta=0"], "dp.delta"),
        (["epsilon=1", "max_grad_norm=0"], "dp.max_grad_norm"),
        (["epsilon=1", "noise_multiplier=-2"], "dp.noise_multiplier"),
        ([], "dp.epsilon"),
    ],
)
def test_privacy_config_refuses_impossible_budgets(overrides, field_name):
    with pytest.raises(ValidationError) as info:
        from_dict(DPConfig, apply_overrides({}, overrides))
    assert info.value.field == field_name


def test_disabled_dp_needs_no_budget_and_trainer_intervals_are_checked():
    assert from_dict(DPConfig, {"enabled": False}).epsilon is None
    with pytest.raises(ValidationError) as info:
        from_dict(TrainerConfig, {"checkpoint_every": 0})
    assert info.value.field == "trainer.checkpoint_every"


_scalars = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
                     st.booleans(), st.none(), st.lists(st.integers(), max_size=3))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["inner", "lr", "budget", "sizes", "name", "bogus"]), _scalars, max_size=4))
def test_parser_never_crashes_with_anything_but_validation_error(data):
    """Any mapping either builds a well-typed config or raises ValidationError (never TypeError/KeyError)."""
    try:
        cfg = from_dict(Outer, data)
    except ValidationError:
        return
    assert isinstance(cfg.lr, float) and isinstance(cfg.inner, Inner)
    assert from_dict(Outer, to_dict(cfg)) == cfg
