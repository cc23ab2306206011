"""Logical shapes: the seed's 75.80B shape in this code's parameter count, and plan --shape."""

from __future__ import annotations

import json

import pytest

from blocktrain.cli.main import main
from blocktrain.errors import ConfigError
from blocktrain.serving.host.shapes import (
    host_blocks,
    measure_throughput,
    parse_shape,
    scale_shape,
    shape_plan,
)


def test_seed_75b_counts_75_80_billion_parameters():
    name, cfg = parse_shape("seed-75b")
    plan = shape_plan(name, cfg, 3)
    assert plan["params_total_billions"] == 75.80, plan["params_total"]
    assert plan["hosts"] == 3 and plan["blocks_per_host"] == [[0], [1], [2]]
    per_host = plan["weight_bytes_fp16_per_host"]
    assert per_host[0] == 2 * (plan["params_per_block"] + 256 * cfg.d_model)
    worker = plan["worker_training_bytes"]
    assert worker["weights"] == 4 * plan["params_per_block"]
    assert worker["adamw_moments"] == 8 * plan["params_per_block"]
    # under the default route = features the last block's worker also holds the two clean
    # streams before it in fp16 (2.4x less than the full model); under state one block (2.9x)
    assert worker["total"] < plan["full_model_training_bytes"] / 2.4
    state = shape_plan(*parse_shape("seed-75b,route=state"), 3)
    assert state["worker_training_bytes"]["total"] < plan["full_model_training_bytes"] / 2.9


def test_a_features_shape_counts_the_upstream_a_worker_holds_and_sends():
    """route = features: the last block's worker also holds the clean streams of the blocks
    before it in fp16, and a hop carries their output over the context; a route = state shape
    neither. The default, relay, serves as features does and trains holding its block only."""
    features = shape_plan(*parse_shape("layers=6,d=256,blocks=3,seq=128,span=1,route=features"))
    relay = shape_plan(*parse_shape("layers=6,d=256,blocks=3,seq=128,span=1"))
    assert relay["model"]["route"] == "relay"
    assert relay["worker_training_bytes"]["upstream_fp16"] == 0
    assert relay["one_sweep_upstream_bytes_per_hop"] == features["one_sweep_upstream_bytes_per_hop"]
    state = shape_plan(*parse_shape("layers=6,d=256,blocks=3,seq=128,span=1,route=state"))
    assert features["model"]["route"] == "features" and state["model"]["route"] == "state"
    up = features["worker_training_bytes"]["upstream_fp16"]
    assert state["worker_training_bytes"]["upstream_fp16"] == 0
    assert 0 < up < 2 * 2 * features["params_per_block"], "two clean streams, 2 bytes a param"
    assert (
        features["worker_training_bytes"]["total"] == state["worker_training_bytes"]["total"] + up
    )
    assert features["one_sweep_upstream_bytes_per_hop"]["fp16"] == 127 * 256 * 2
    assert state["one_sweep_upstream_bytes_per_hop"]["fp16"] == 0
    assert features["one_sweep_state_bytes_per_hop"] == state["one_sweep_state_bytes_per_hop"]
    with pytest.raises(ConfigError, match="route"):
        parse_shape("seed-75b,route=sideways")


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        ("layers=12,d=768,blocks=3", lambda c: (c.layers, c.d_model, c.n_heads) == (12, 768, 6)),
        ("seed-75b,span=16", lambda c: c.span == 16 and c.d_model == 13696),
        (
            "d=96,layers=3,blocks=3,heads=2,seq=32,k=4",
            lambda c: (c.n_heads, c.seq_len, c.span) == (2, 32, 4),
        ),
    ],
)
def test_specs(spec, check):
    assert check(parse_shape(spec)[1])


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("seed-1t", "unknown shape"),
        ("layers=12,width=3", "expected KEY=VALUE"),
        ("d=big", "expected a number"),
        ("layers=10,blocks=3", "multiple of blocks"),
        ("seq=100,span=64", "must divide"),
    ],
)
def test_bad_specs_say_why(spec, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_shape(spec)


def test_blocks_are_split_contiguously_over_hosts():
    assert host_blocks(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ConfigError):
        host_blocks(3, 4)


def test_throughput_on_a_scaled_shape_runs_and_reports_both_paths():
    _, cfg = parse_shape("d=64,layers=3,blocks=3,seq=32,span=8")
    assert scale_shape(parse_shape("seed-75b")[1], 32).d_model == 384
    t = measure_throughput(cfg, prompt_bytes=4, output_bytes=8, repeats=1)
    assert t["sweeps"] == 1 and t["one_sweep_bytes_per_s"] > 0 and t["ar_bytes_per_s"] > 0


def test_plan_shape_json(capsys):
    assert main(["plan", "--shape", "seed-75b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_total_billions"] == 75.80 and len(out["weight_bytes_fp16_per_host"]) == 3


def test_plan_shape_throughput_json(capsys):
    assert (
        main(
            [
                "plan",
                "--shape",
                "d=64,layers=3,blocks=3,seq=64,span=8",
                "--throughput",
                "8",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["throughput"]["weights"] == "random (untrained)"
    assert out["throughput"]["output_bytes"] == 8
    shape = ["plan", "--shape", "d=64,layers=3,blocks=3,seq=64,span=8", "--throughput", "8"]
    assert main([*shape, "--set", "scale=2", "--json"]) == 0  # --throughput's width divisor
    assert json.loads(capsys.readouterr().out)["throughput"]["width_divisor"] == 2
