"""`--set NAME=VALUE` takes the aggregator settings that have no flag of their own (and those
that have one), on aggregator, cluster and simulate; a removed flag and an unknown key fail
clearly."""

from __future__ import annotations

import pytest

from blocktrain.cli.common import settings_overrides, split_sets
from blocktrain.cli.main import build_parser
from blocktrain.errors import ConfigError


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_a_setting_is_set_by_its_name_beside_config_keys() -> None:
    args = parse("simulate", "--set", "probe_gain_z=6", "d_model=32", "--set", "quorum=1")
    config, settings = split_sets(args)
    assert config == ["d_model=32"]
    assert settings == {"probe_gain_z": 6.0, "quorum": 1.0}
    args = parse("aggregator", "--state", "s", "--deadline", "30", "--set", "grace_s=none")
    assert settings_overrides(args) == {"grace_s": None, "deadline_s": 30.0}


def test_a_flag_and_its_set_are_not_both_given() -> None:
    args = parse("cluster", "--workers", "2", "--rounds", "1", "--out", "o",
                 "--deadline", "30", "--set", "deadline_s=20")  # fmt: skip
    with pytest.raises(ConfigError, match="give --deadline or --set deadline_s"):
        settings_overrides(args)


def test_an_unknown_key_names_the_nearest() -> None:
    args = parse("aggregator", "--state", "s", "--set", "probe_gainz=6")
    with pytest.raises(ConfigError, match="unknown --set key 'probe_gainz'; nearest: probe_gain_z"):
        split_sets(args)
    args = parse("train", "--set", "quorum=1")  # train runs no protocol
    with pytest.raises(ConfigError, match="unknown --set key 'quorum'"):
        split_sets(args)
    args = parse("simulate", "--set", "keep_versions=3")
    with pytest.raises(ConfigError, match="the simulator does not model"):
        split_sets(args)


def test_a_removed_flag_is_argparses_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("simulate", "--probe-gain-z", "6")
    assert exc.value.code == 2
    assert "unrecognized arguments: --probe-gain-z" in capsys.readouterr().err
