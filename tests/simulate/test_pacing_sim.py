"""Adaptive pacing in the simulator (issue 30): the same round engine, so one worker three
times slower than the rest is told fewer steps and its updates count instead of coming late."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.errors import ConfigError
from blocktrain.presets import preset
from blocktrain.simulate import Dist, Regime, SimSpec, simulate
from blocktrain.training.costs import worker_costs
from blocktrain.training.profiles import PROFILES
from tests.conftest import micro_config

PACED = Regime(
    "paced",
    step_s=Dist.const(1.0),
    deadline=1.5,  # a normal worker fits; one three times slower does not
)
# the cpu profile's steps on a fast link: the round is the compute, so a slowdown tells
FAST_LINK = dataclasses.replace(
    PROFILES["cpu"],
    name="cpu-fast-link",
    link_down_bytes_per_s=1e9,
    link_up_bytes_per_s=1e9,
    latency_s=0.01,
    sources={
        **PROFILES["cpu"].sources,
        "link_down_bytes_per_s": "a test's",
        "latency_s": "a test's",
    },
)
SLOW = 5


def run(pacing: str, **kw: object) -> dict:
    protocol = {"local_steps": 8, "effect_probe": "off", "pacing": pacing}
    spec = SimSpec(
        preset("tiny"),
        6,
        6,
        protocol,
        timing_only=True,
        slowdown={SLOW: 3.0},
        profile=FAST_LINK,
        **kw,  # type: ignore[arg-type]
    )
    report, _ = simulate(spec, [PACED], None, None)
    return dict(report["regimes"]["paced"])


def test_the_slow_worker_is_late_under_a_fixed_deadline_and_counts_when_paced() -> None:
    fixed, adaptive = run("fixed"), run("adaptive")
    slow = {name: r["workers"][SLOW] for name, r in (("fixed", fixed), ("adaptive", adaptive))}
    assert slow["fixed"]["accepted"] == 0 and slow["fixed"]["refused"].get("late", 0) >= 2
    # paced: its first round (no reading yet) comes late, then every update is in time
    assert slow["adaptive"]["refused"] == {"late": 1}
    assert slow["adaptive"]["accepted"] == 4
    # it ran fewer steps a round than H = 8 (8 in its first round, then what fits)
    assert 8 < slow["adaptive"]["local_steps"] < 8 * 3
    for r in (fixed, adaptive):  # the others keep H and every round
        others = [w for w in r["workers"] if w["worker_id"] != SLOW]
        assert all(w["accepted"] == 6 and w["local_steps"] == 6 * 8 for w in others)
    assert adaptive["updates"]["accepted"] == fixed["updates"]["accepted"] + 4
    # rounds waited for the slow replica to its deadline; paced, it passes and they close
    assert adaptive["virtual_time_s"] < fixed["virtual_time_s"]
    assert run("fixed", seed=0)["rounds"] == fixed["rounds"], "same seed, same run"


def test_slowdown_names_a_worker_of_the_run() -> None:
    with pytest.raises(ConfigError, match="slowdown 6"):
        SimSpec(preset("tiny"), 6, 2, {}, timing_only=True, slowdown={6: 3.0})
    with pytest.raises(ConfigError, match="slowdown 0"):
        SimSpec(preset("tiny"), 6, 2, {}, timing_only=True, slowdown={0: 0.0})


def test_paced_simulation_with_real_local_training(corpus: Path) -> None:
    """The slow worker trains the steps it is told, for real, and its updates are accepted."""
    cfg = apply_overrides(micro_config(), ["steps=16"])
    protocol = {"local_steps": 4, "effect_probe": "off", "pacing": "adaptive"}
    # a chip on which the micro block's step takes a second, so that the compute is the round
    flops = max(c.flops_per_step for c in worker_costs(cfg, local_steps=4))
    chip = dataclasses.replace(FAST_LINK, peak_flops_per_s=flops, utilisation=1.0)
    spec = SimSpec(
        cfg,
        6,
        4,
        protocol,
        seed=cfg.seed,
        eval_bytes=256,
        final_bytes=256,
        slowdown={SLOW: 3.0},
        profile=chip,
    )
    report, _ = simulate(spec, [PACED], load_split(corpus, "train"), load_split(corpus, "valid"))
    result = report["regimes"]["paced"]
    slow = result["workers"][SLOW]
    assert slow["accepted"] >= 2 and slow["refused"] == {"late": 1}
    assert slow["local_steps"] < 4 * 4
    assert report["slowdown"] == {str(SLOW): 3.0}
    assert result["final_ce"] < result["initial_ce"]
