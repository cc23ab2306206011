"""Regimes: distributions, files, errors, and the participation each named regime realises."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from blocktrain.errors import ConfigError
from blocktrain.presets import preset
from blocktrain.simulate import REGIMES, Dist, Regime, SimSpec, load_regime, parse_regimes, simulate


def test_distributions_draw_what_they_say() -> None:
    rng = random.Random(0)
    assert Dist.const(2.5).draw(rng) == 2.5
    logn = [Dist.lognormal(0.5, 0.3).draw(rng) for _ in range(4000)]
    assert statistics.median(logn) == pytest.approx(0.5, rel=0.05)
    uni = [Dist("uniform", low=1, high=3).draw(rng) for _ in range(4000)]
    assert min(uni) >= 1 and max(uni) <= 3
    expo = [Dist("exponential", mean=2.0).draw(rng) for _ in range(4000)]
    assert statistics.mean(expo) == pytest.approx(2.0, rel=0.08)
    assert Dist("exponential", mean=2.0).typical == pytest.approx(statistics.median(expo), rel=0.1)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "gamma"},
        {"kind": "const", "value": 0},
        {"kind": "lognormal", "median": -1},
        {"kind": "uniform", "low": 3, "high": 1},
        {"kind": "const", "value": 1, "colour": 2},
        "fast",
    ],
)
def test_bad_distributions_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError):
        Dist.parse(bad, "step_s")


def test_regime_files_round_trip(tmp_path: Path) -> None:
    toml = tmp_path / "flaky.toml"
    toml.write_text(
        'deadline = 1.4\ndropout = 0.05\nstep_s = {kind = "lognormal", median = 0.5, sigma = 0.3}\n'
        "latency_s = 0.08\n"
    )
    regime = load_regime(str(toml))
    assert regime.name == "flaky" and regime.dropout == 0.05 and regime.latency_s.value == 0.08
    as_json = tmp_path / "flaky2.json"
    as_json.write_text(json.dumps({**regime.to_dict(), "name": "flaky2"}))
    again = load_regime(str(as_json))
    assert {**again.to_dict(), "name": "flaky"} == regime.to_dict()
    assert [r.name for r in parse_regimes(f"lockstep,{toml}")] == ["lockstep", "flaky"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"name": "x", "dropout": 1.5}', "dropout"),
        ('{"name": "x", "deadline": "soon"}', "deadline"),
        ('{"name": "x", "jitter": 1}', "unknown key"),
        ("[1, 2]", "one table"),
        ("{not json", "cannot be read"),
    ],
)
def test_bad_regime_files_say_what_is_wrong(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_regime(str(path))


def test_unknown_and_repeated_regimes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown regime"):
        parse_regimes("lockstep,typo")
    with pytest.raises(ConfigError, match="repeat"):
        parse_regimes("mild,mild")
    with pytest.raises(ConfigError, match="does not exist"):
        parse_regimes(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError):
        Regime("bad name!")


def test_named_regimes_realise_the_seed_participation() -> None:
    """lockstep: every update; mild: about 90%; wan: about 42% (6 workers, tiny shape, the
    mean over seeds; each run's realised figure scatters around it)."""
    cfg = preset("tiny")
    got: dict[str, list[float]] = {name: [] for name in REGIMES}
    for seed in range(4):
        report, _ = simulate(
            SimSpec(cfg, 6, 20, {}, seed=seed, timing_only=True),
            list(REGIMES.values()),
            None,
            None,
        )
        for name, result in report["regimes"].items():
            got[name].append(result["participation"])
    assert got["lockstep"] == [1.0] * 4
    assert 0.85 <= statistics.mean(got["mild"]) <= 0.96
    assert 0.34 <= statistics.mean(got["wan"]) <= 0.50
