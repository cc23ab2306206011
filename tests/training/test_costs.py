"""The cost model: FLOPs counted on meta are the CPU's, memory is plan's, bytes are the formula's,
and the profiles' figures each name a source."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.errors import ConfigError
from blocktrain.model import BlockStack, target_table
from blocktrain.presets import preset
from blocktrain.serving.host.shapes import parse_shape, shape_plan, shape_run
from blocktrain.training.costs import (
    clean_stream_params,
    cost_plan,
    fit_by_blocks,
    reference_cost,
    unit_costs,
    worker_costs,
)
from blocktrain.training.flops import count_flops
from blocktrain.training.loss import BlockLoss
from blocktrain.training.plan import plan, worker_state_bytes
from blocktrain.training.profiles import FIGURES, PROFILES, DeviceProfile, device_profile
from tests.conftest import micro_config

ROOT = Path(__file__).resolve().parents[2]
ROUTES = ("state", "features", "relay")


def routed(cfg: RunConfig, route: str) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, route=route))


@torch.no_grad()
def cpu_forward_flops(cfg: RunConfig, b: int) -> int:
    """One batch of block b's loss on CPU, as a worker runs it, counted as it runs: under
    features with BlockStack.upstream (the clean streams of blocks 0..b-1), under relay with a
    stream handed in (what block b-1's worker relays)."""
    m = cfg.model
    stack = BlockStack(m, cfg.seed)
    upstream = None
    if m.route == "features":
        upstream = stack.upstream
    elif m.route == "relay":

        def upstream(index: int, x: torch.Tensor) -> torch.Tensor | None:
            return None if index == 0 else torch.randn(*x.shape, m.d_model)

    loss = BlockLoss(m, target_table(cfg.seed, m.d_model), upstream)
    x = torch.randint(
        0, 256, (cfg.train.batch_size, m.seq_len), generator=torch.Generator().manual_seed(0)
    )
    return count_flops(lambda: loss(stack.block(b), b, x, torch.Generator().manual_seed(1))).total


@pytest.mark.parametrize("route", ROUTES)
def test_flops_on_meta_are_the_cpu_count_at_the_tiny_shape(route: str) -> None:
    cfg = routed(preset("tiny"), route)
    for cost in worker_costs(cfg, local_steps=10):
        b, flops = cost.index, cost.flops
        cpu = cpu_forward_flops(cfg, b)
        # integers: exactly equal, one sequence on meta times the batch
        assert flops["train"] % 3 == 0 and flops["train"] // 3 + flops["upstream"] == cpu, (
            b,
            flops,
            cpu,
        )
        assert flops["total"] == flops["train"] + flops["upstream"]
        if route != "features" or b == 0:
            assert flops["upstream"] == 0, (route, b)
        else:
            assert flops["upstream"] > 0
    # the blocks all have one shape: only the upstream forwards tell them apart
    costs = worker_costs(cfg, local_steps=10)
    assert len({c.flops["train"] for c in costs}) == 1


def test_flops_of_a_span_run_and_of_a_reference_are_the_cpu_count() -> None:
    cfg = apply_overrides(micro_config(), ["span=4", "route=features"])
    for cost in worker_costs(cfg, local_steps=2):
        cpu = cpu_forward_flops(cfg, cost.index)
        assert cost.flops["train"] // 3 + cost.flops["upstream"] == cpu, cost.index
    tiny = preset("tiny")
    ref = reference_cost(tiny, local_steps=10)
    # bench/throughput.py measured the reference's step at the same count
    assert ref.flops_per_step == 8_254_390_272
    assert unit_costs(tiny, "reference", local_steps=10) == {0: ref}


@pytest.mark.parametrize("route", ROUTES)
def test_memory_is_plan_s_and_the_shapes_and_the_formula(route: str) -> None:
    cfg = routed(micro_config(), route)
    m, batch = cfg.model, cfg.train.batch_size
    costs = worker_costs(cfg, local_steps=3)
    assert plan(cfg)["worker_state_bytes_per_block"] == [c.memory_bytes for c in costs]
    assert worker_state_bytes(cfg) == [c.memory_bytes for c in costs]
    params = plan(cfg)["params_per_block"][0]
    stream = clean_stream_params(BlockStack(m, cfg.seed).block(0))
    step = batch * m.seq_len * (m.d_model + 5)
    for c in costs:
        b = c.index
        by_hand = params * 16 + 256 * m.d_model * 4
        if route == "features":
            by_hand += b * stream * 2
        if route == "relay":
            by_hand += step * (b > 0) + step * (b < m.blocks - 1)
            by_hand += batch * m.seq_len * m.d_model * 4 * (b > 0)
        assert c.memory_bytes == by_hand, (route, b)
        assert c.memory["total"] == sum(v for k, v in c.memory.items() if k != "total")
    name, shape = parse_shape(f"layers=6,d=64,blocks=3,seq=32,span=1,route={route}")
    memories = [c.memory for c in worker_costs(shape_run(shape), local_steps=1)]
    largest = max(memories, key=lambda memory: memory["total"])
    assert shape_plan(name, shape)["worker_training_bytes"] == largest


def test_bytes_per_round_by_hand() -> None:
    cfg = micro_config()  # d = 32, T = 16, batch 4, 3 blocks
    h = 3
    params = plan(cfg)["params_per_block"][0]
    stream = h * 4 * 16 * (32 + 5)
    for route in ROUTES:
        for c in worker_costs(routed(cfg, route), local_steps=h, wire_dtype="fp16"):
            b, got = c.index, c.bytes_per_round
            want = {
                "pull": 2 * params,
                "push": 2 * params,
                "upstream": 2 * params * b if route == "features" else 0,
                "stream_in": stream if route == "relay" and b > 0 else 0,
                "stream_out": stream if route == "relay" and b < 2 else 0,
            }
            want["down"] = want["pull"] + want["upstream"] + want["stream_in"]
            want["up"] = want["push"] + want["stream_out"]
            want["total"] = want["down"] + want["up"]
            assert got == want, (route, b)
    fp32 = worker_costs(routed(cfg, "features"), local_steps=h, wire_dtype="fp32")[
        2
    ].bytes_per_round
    assert fp32["pull"] == 4 * params and fp32["upstream"] == 2 * 4 * params
    with pytest.raises(ConfigError, match="wire dtype"):
        worker_costs(cfg, local_steps=h, wire_dtype="int4")


def test_seconds_under_a_profile_by_hand() -> None:
    profile = DeviceProfile(
        name="toy",
        description="round numbers",
        memory_bytes=10**6,
        peak_flops_per_s=2e9,
        utilisation=0.5,
        link_down_bytes_per_s=1e6,
        link_up_bytes_per_s=5e5,
        latency_s=0.1,
        sources={name: "made up for the test (assumed)" for name in FIGURES},
    )
    cost = worker_costs(micro_config(), local_steps=4)[1]
    step = cost.flops_per_step / 1e9
    assert cost.step_s(profile) == pytest.approx(step)
    b = cost.bytes_per_round
    transfer = b["down"] / 1e6 + b["up"] / 5e5
    assert cost.round_s(profile) == pytest.approx(4 * step + transfer + 0.2)
    assert cost.round_s(profile, compute_factor=2) == pytest.approx(8 * step + transfer + 0.2)
    assert cost.fits(profile) == (cost.memory_bytes <= 10**6)


def test_the_plan_names_the_slowest_block_and_the_fewest_blocks_that_fit() -> None:
    cfg = routed(preset("tiny"), "features")
    result = cost_plan(cfg, PROFILES["cpu"], local_steps=10)
    assert result["slowest_block"] == 2, "the last block runs two upstream forwards"
    assert [row["block"] for row in result["per_block"]] == [0, 1, 2]
    assert result["fewest_blocks_that_fit"] == 1
    _, shape = parse_shape("layers=32,d=4096,blocks=4,route=state")
    table = fit_by_blocks(shape_run(shape), PROFILES["consumer-gpu"])
    assert [row["blocks"] for row in table] == [1, 2, 4, 8, 16, 32]
    fits = [row["fits"] for row in table]
    assert fits == sorted(fits), "more blocks, smaller workers"
    shape_cost = cost_plan(shape_run(shape), PROFILES["consumer-gpu"], local_steps=10)
    assert shape_cost["fewest_blocks_that_fit"] == table[fits.index(True)]["blocks"]


def test_every_profile_figure_names_its_source() -> None:
    for profile in PROFILES.values():
        assert set(profile.sources) == set(FIGURES), profile.name
        assert profile.flops_per_s == pytest.approx(profile.peak_flops_per_s * profile.utilisation)
    for name in ("consumer-gpu", "datacenter-gpu"):
        assert "assumed" in PROFILES[name].sources["utilisation"], name
    with pytest.raises(ConfigError, match="profiles: consumer-gpu, datacenter-gpu, cpu"):
        device_profile("laptop")
    with pytest.raises(ConfigError, match="no source for latency_s"):
        DeviceProfile("x", "", 1, 1.0, 1.0, 1.0, 1.0, 1.0, {n: "s" for n in FIGURES[:-1]})


def test_the_cpu_profile_is_the_repository_s_measurement() -> None:
    data = json.loads((ROOT / "benchmarks" / "results" / "throughput.json").read_text())
    row = next(r for r in data["results"] if (r["preset"], r["model"]) == ("small", "blocktrain"))
    cpu = PROFILES["cpu"]
    assert cpu.peak_flops_per_s == pytest.approx(row["matmul_rate_gflops"] * 1e9, rel=1e-12)
    assert cpu.flops_per_s == pytest.approx(row["achieved_gflops"] * 1e9, rel=1e-9)
