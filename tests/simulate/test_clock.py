"""The simulator's clock comes from the costs (training/costs.py) under a device profile: a
step takes its block's FLOPs over the profile's rate, a message its bytes over the profile's
link. A constant step time fails these: the shapes, routes and units below differ only in what
their workers compute and move."""

from __future__ import annotations

import pytest

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.presets import preset
from blocktrain.simulate import REGIMES, SimSpec, simulate
from blocktrain.training.costs import unit_costs
from blocktrain.training.profiles import PROFILES

ROUNDS = 3
H = 10


def lockstep(cfg: RunConfig, unit: str = "block", **kw: object) -> dict:
    """A timing-only lockstep run whose rounds close as soon as every replica reported."""
    protocol = {"local_steps": H, "min_round_s": 0.0}
    spec = SimSpec(cfg, 6, ROUNDS, protocol, timing_only=True, unit=unit, **kw)  # type: ignore[arg-type]
    report, _ = simulate(spec, [REGIMES["lockstep"]], None, None)
    return report


def expected_time(cfg: RunConfig, unit: str = "block", profile: str = "cpu") -> float:
    """Identical workers, so every round of a block lasts its nominal round (H steps, its
    transfers and two latencies) and two latencies more (the push's answer and the next pull);
    the first round starts with the pull's one latency in flight: R x (round + 2L) - L."""
    p = PROFILES[profile]
    costs = unit_costs(cfg, unit, local_steps=H)
    slowest = max(c.round_s(p) for c in costs.values())
    return ROUNDS * (slowest + 2 * p.latency_s) - p.latency_s


def routed(name: str, route: str) -> RunConfig:
    return apply_overrides(preset(name), [f"route={route}"])


@pytest.mark.parametrize(
    ("name", "route", "unit"),
    [
        ("tiny", "state", "block"),
        ("tiny", "features", "block"),
        ("small", "state", "block"),
        ("tiny", "state", "reference"),
    ],
)
def test_virtual_time_is_the_costs_nominal_rounds(name: str, route: str, unit: str) -> None:
    cfg = routed(name, route)
    report = lockstep(cfg, unit)
    result = report["regimes"]["lockstep"]
    assert result["participation"] == 1.0
    # the pushes' bodies carry a safetensors header beyond the costs' dense delta: a few KB
    assert result["virtual_time_s"] == pytest.approx(
        expected_time(report_cfg(report), unit), rel=1e-3
    )
    assert report["profile"]["name"] == "cpu", "the simulator's default profile"
    assert all(c["step_s"] > 0 for c in report["costs"])


def report_cfg(report: dict) -> RunConfig:
    return RunConfig.from_dict(report["config"])


def test_time_follows_the_flops_and_the_bytes_of_each_shape_and_route() -> None:
    times = {
        (name, route): lockstep(routed(name, route))["regimes"]["lockstep"]["virtual_time_s"]
        for name, route in (("tiny", "state"), ("tiny", "features"), ("small", "state"))
    }
    # features: the last block runs two upstream forwards and pulls two blocks more
    assert times[("tiny", "features")] > 1.2 * times[("tiny", "state")]
    # small: 14x the FLOPs of a tiny block's step and 4.9x its bytes
    assert times[("small", "state")] > 4 * times[("tiny", "state")]
    for key, seconds in times.items():
        assert seconds == pytest.approx(expected_time(routed(*key)), rel=1e-3), key


def test_the_profile_sets_the_seconds() -> None:
    cfg = routed("tiny", "state")
    cpu = lockstep(cfg)["regimes"]["lockstep"]
    gpu = lockstep(cfg, profile=PROFILES["consumer-gpu"])["regimes"]["lockstep"]
    assert gpu["virtual_time_s"] < cpu["virtual_time_s"], "the same link, 70x the FLOP/s"
    assert gpu["virtual_time_s"] == pytest.approx(
        expected_time(cfg, profile="consumer-gpu"), rel=1e-3
    )
    # the deadline is the regime's multiple of the slowest block's nominal round
    nominal = max(
        c.round_s(PROFILES["cpu"]) for c in unit_costs(cfg, "block", local_steps=H).values()
    )
    assert cpu["deadline_s"] == pytest.approx(REGIMES["lockstep"].deadline * nominal)


def test_relay_moves_its_streams_and_runs_as_a_pipeline() -> None:
    """route = relay: the blocks' workers send and receive the streams' true sizes, and block b's
    round r waits for block b-1's round r stream, so the last block ends B-1 rounds later."""
    cfg = routed("tiny", "relay")
    relay = lockstep(cfg)["regimes"]["lockstep"]
    state = lockstep(routed("tiny", "state"))["regimes"]["lockstep"]
    # each round's stream: H steps of batch x T x (d + 5) bytes, in to blocks 1, 2, out of 0, 1
    stream = H * 32 * 64 * (128 + 5)
    for way in ("down", "up"):
        extra = relay["bytes"][way] - state["bytes"][way]
        assert ROUNDS * 2 * 2 * stream <= extra < ROUNDS * 2 * 2 * (stream + 4096), way
    p = PROFILES["cpu"]
    one = max(c.round_s(p) for c in unit_costs(cfg, "block", local_steps=H).values())
    parallel = expected_time(cfg)
    fill = (cfg.model.blocks - 1) * (one + 2 * p.latency_s)
    assert parallel < relay["virtual_time_s"] <= parallel + fill * 1.01
