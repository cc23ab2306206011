import dataclasses
import re

import pytest

from blocktrain.config import ModelConfig, RunConfig, apply_overrides, parse_blocks, settable_keys
from blocktrain.errors import ConfigError
from blocktrain.presets import preset


def test_presets_are_valid_and_distinct():
    shapes = {name: preset(name).model for name in ("tiny", "small", "paper")}
    assert shapes["paper"].blocks == 3 and shapes["paper"].layers_per_block == 4
    assert len({(m.d_model, m.layers) for m in shapes.values()}) == 3


def test_overrides_accept_short_and_sectioned_keys():
    cfg = apply_overrides(
        preset("tiny"), ["lr=0.01", "model.span=4", "seed=9", "sigma_data=none", "aux_weight=0"]
    )
    assert cfg.train.lr == 0.01 and cfg.model.span == 4 and cfg.seed == 9
    assert cfg.model.sigma_data is None and cfg.model.aux_weight == 0
    cfg = apply_overrides(cfg, ["gates_open=false", "sigma_data=0.5"])
    assert cfg.model.gates_open is False and cfg.model.sigma_data == 0.5


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("nope=1", "unknown --set key"),
        ("train.span=4", "unknown --set key"),
        ("span", "KEY=VALUE"),
        ("layers=2.5", "expected a int"),
        ("gates_open=maybe", "expected a bool"),
    ],
)
def test_bad_overrides_name_the_problem(item, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(preset("tiny"), [item])


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"span": 3}, "span"),
        ({"sigma_min": 0.0}, "sigma_min"),
        ({"sigma_max": 0.5}, "sigma_max"),
        ({"blocks": 4, "layers": 3}, "blocks"),
        ({"layers": 4, "blocks": 3}, "layers"),
        ({"n_heads": 5}, "n_heads"),
    ],
)
def test_invalid_model_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(ModelConfig(), **changes)


def test_config_round_trips_through_json_dict():
    cfg = apply_overrides(preset("small"), ["span=4", "sigma_data=0.1"])
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_configs_written_before_the_route_load_as_state():
    """A run saved before `route` existed passed only z between its blocks: it loads as
    `route = state` whatever the default is (its later blocks never read features)."""
    for route in ("state", "features"):
        data = apply_overrides(preset("tiny"), [f"route={route}"]).to_dict()
        assert RunConfig.from_dict(data).model.route == route, "a saved route is kept"
    del data["model"]["route"]
    assert RunConfig.from_dict(data).model.route == "state"
    assert RunConfig.from_dict({}).model == ModelConfig(), "no model section: the defaults"


def test_configs_written_with_the_masked_process_s_keys_load_unless_masked():
    """Runs saved while `process` existed name their Gaussian process: they load as before; a
    masked run (its code removed) is one clear refusal."""
    cfg = preset("tiny")
    data = cfg.to_dict()
    data["model"].update(process="gaussian", mask_loss="mean", mask_suffix_share=0.5)
    assert RunConfig.from_dict(data) == cfg
    data["model"]["process"] = "masked"
    with pytest.raises(ConfigError, match="bb9b624"):
        RunConfig.from_dict(data)


def test_every_field_is_settable():
    keys = settable_keys()
    assert "d_model" in keys and "lr" in keys and "seed" in keys


def test_parse_blocks_is_one_rule_for_every_command():
    assert parse_blocks("0") == (0,)
    assert parse_blocks("2, 0,") == (0, 2), "sorted; spaces and a trailing comma are fine"
    for bad in ("", ",", "a", "-1", "1,-2", "1,1", "0x1", "1.0", "+1"):
        with pytest.raises(ConfigError, match=re.escape(f"--blocks {bad!r}: expected distinct")):
            parse_blocks(bad)
    with pytest.raises(ConfigError, match="--block '-1'"):
        parse_blocks("-1", "--block")
