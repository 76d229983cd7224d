"""Property-based tests (hypothesis) of the typed config parser: round trips, overrides, and that every bad value
or unknown key anywhere is a ValidationError naming its dotted path (never a crash, never a silent default)."""

import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.utils.config import apply_overrides, dump_config, from_dict, parse_override, to_dict
from dporl.utils.validation import ValidationError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
probability = st.floats(min_value=1e-12, max_value=0.999, allow_nan=False)

dp_configs = st.builds(
    DPConfig,
    enabled=st.just(True),
    epsilon=positive,
    delta=probability,
    noise_multiplier=st.none() | positive,
    max_grad_norm=positive,
    accountant=st.sampled_from(["rdp", "prv", "pld"]),
    clipping=st.sampled_from(["bookkeeping", "ghost", "opacus", "naive"]),
    noise_seed=st.none() | st.integers(0, 2**62),
)
trainer_configs = st.builds(
    TrainerConfig,
    max_steps=st.none() | st.integers(0, 10**7),
    seed=st.integers(0, 2**31),
    log_every=st.integers(1, 10**4),
    journal_every=st.integers(1, 10**4),
    progress=st.booleans(),
    optimizer=st.builds(
        OptimizerConfig,
        name=st.sampled_from(["adam", "sgd", "rmsprop"]),
        lr=positive,
        schedule=st.sampled_from(["constant", "inverse_time"]),
    ),
)


@SETTINGS
@given(dp_configs, trainer_configs)
def test_configs_round_trip_through_dicts_and_yaml(dp, trainer):
    for config in (dp, trainer):
        assert from_dict(type(config), to_dict(config)) == config
        assert from_dict(type(config), yaml.safe_load(dump_config(config))) == config


identifiers = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)


@SETTINGS
@given(trainer_configs, identifiers, st.booleans())
def test_an_unknown_key_anywhere_is_named(trainer, key, nested):
    data = to_dict(trainer)
    if nested:
        if key in data["optimizer"]:
            return
        data["optimizer"][key] = 1
        expected = f"optimizer.{key}"
    else:
        if key in data:
            return
        data[key] = 1
        expected = key
    try:
        from_dict(TrainerConfig, data)
    except ValidationError as exc:
        assert exc.field == expected
    else:
        raise AssertionError(f"unknown key {expected} was accepted")


# Values of the wrong type for each field kind (ints reject fractional floats and strings; floats reject strings
# that are not numbers; literals reject anything outside their set; bools reject non-bools).
wrong_values = {
    "seed": st.one_of(
        st.text(min_size=1),
        st.floats().filter(lambda x: not (math.isfinite(x) and x.is_integer())),  # includes inf and nan (YAML .inf)
        st.sampled_from([float("inf"), float("-inf"), float("nan")]),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
    ),
    "progress": st.one_of(st.integers(), st.text(), st.floats()),
    "optimizer.lr": st.one_of(st.text().filter(lambda s: not _is_number(s)), st.booleans(), st.floats(max_value=0.0), st.just(float("nan"))),
    "optimizer.name": st.text().filter(lambda s: s not in ("adam", "sgd", "rmsprop")),
}


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


@SETTINGS
@given(st.data())
def test_a_wrong_value_is_named_by_its_dotted_path(data):
    path = data.draw(st.sampled_from(sorted(wrong_values)))
    value = data.draw(wrong_values[path])
    config = {"optimizer": {}}
    node = config
    *parents, leaf = path.split(".")
    for parent in parents:
        node = node[parent]
    node[leaf] = value
    try:
        from_dict(TrainerConfig, config)
    except ValidationError as exc:
        assert exc.field == path, (exc.field, path, value)
    else:
        raise AssertionError(f"{path}={value!r} was accepted")


scalars = st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(), identifiers,
                    st.floats(allow_nan=False, allow_infinity=False, width=32))


@SETTINGS
@given(st.lists(identifiers, min_size=1, max_size=4), scalars)
def test_overrides_set_exactly_the_dotted_key(keys, value):
    text = ".".join(keys) + "=" + yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    parsed_keys, parsed = parse_override(text)
    assert parsed_keys == keys
    assert parsed == value or (isinstance(value, float) and math.isclose(parsed, value, rel_tol=1e-6))
    result = apply_overrides({"untouched": {"x": 1}}, [text])
    node = result
    for key in keys[:-1]:
        node = node[key]
    assert node[keys[-1]] == parsed
    if keys[0] != "untouched":
        assert result["untouched"] == {"x": 1}


@SETTINGS
@given(st.text(max_size=30))
def test_any_override_text_parses_or_is_a_validation_error(text):
    try:
        parse_override(text)
    except ValidationError:
        pass
