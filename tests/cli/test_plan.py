"""`blocktrain plan --profile`: each block's worker's costs, in both the preset and the shape
form, keeping every key plan printed before."""

from __future__ import annotations

import json

import pytest

from blocktrain.cli.main import main
from tests.cli.test_cli import fails_cleanly

PER_BLOCK = {"memory_bytes", "flops_per_step", "bytes_per_round", "step_s", "round_s", "fits"}


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_plan_json_adds_the_costs_and_keeps_its_keys(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--preset", "tiny")
    for key in ("worker_state_bytes_per_block", "params_per_block", "sigma_boundaries"):
        assert key in result, key
    assert result["profile"]["name"] == "consumer-gpu", "the default profile"
    assert result["local_steps"] == 10, "the protocol's default H"
    rows = result["per_block"]
    assert [row["block"] for row in rows] == [0, 1, 2]
    assert all(set(row) >= PER_BLOCK for row in rows)
    assert [row["memory_bytes"] for row in rows] == result["worker_state_bytes_per_block"]
    assert result["slowest_block"] == 1  # route = relay: it takes a stream and relays one
    assert [r["blocks"] for r in result["fit_by_blocks"]] == [1, 3]
    assert result["fewest_blocks_that_fit"] == 1
    cpu = plan_json(capsys, "--preset", "tiny", "--profile", "cpu", "--local-steps", "20")
    assert cpu["profile"]["name"] == "cpu" and cpu["local_steps"] == 20
    assert cpu["per_block"][0]["step_s"] > rows[0]["step_s"], "2 cores against a GPU"
    for key in ("pull", "push"):  # a round's relayed stream grows with H; the weights do not
        assert cpu["per_block"][0]["bytes_per_round"][key] == rows[0]["bytes_per_round"][key]
    assert (
        cpu["per_block"][0]["bytes_per_round"]["stream_out"]
        == 2 * (rows[0]["bytes_per_round"]["stream_out"])
    )


def test_plan_shape_json_adds_the_costs(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--shape", "layers=32,d=4096,blocks=8,route=relay")
    assert result["worker_training_bytes"]["total"] == max(
        row["memory_bytes"] for row in result["per_block"]
    )
    assert len(result["per_block"]) == 8 and all(set(r) >= PER_BLOCK for r in result["per_block"])
    assert not result["fits"], "an 855M-parameter block does not train in 8 GiB"
    assert [r["blocks"] for r in result["fit_by_blocks"]] == [1, 2, 4, 8, 16, 32]
    assert result["fewest_blocks_that_fit"] == 16
    middle = result["per_block"][3]["bytes_per_round"]
    assert middle["stream_in"] == middle["stream_out"] == 10 * 32 * 1024 * (4096 + 5)


def test_plan_text_names_the_slowest_block_and_the_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "tiny", "--profile", "datacenter-gpu"]) == 0
    out = capsys.readouterr().out
    assert "profile           datacenter-gpu" in out
    assert "slowest block     1" in out
    assert "the fewest blocks that fit: 1" in out


def test_an_unknown_profile_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    fails_cleanly(capsys, ["plan", "--profile", "laptop"], "profiles: consumer-gpu, datacenter-gpu")
    fails_cleanly(capsys, ["plan", "--shape", "seed-75b", "--profile", "x"], "unknown profile")
    fails_cleanly(capsys, ["plan", "--local-steps", "0"], "--local-steps 0 must be positive")


def test_plan_prices_every_route_and_picks_a_composing_one_that_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The routes trade memory and compute for bytes: at a 7B shape on the consumer GPU only
    relay composes within 8 GiB; at tiny the streams outweigh the blocks a features worker
    pulls, so its rounds are the shorter."""
    big = plan_json(capsys, "--shape", "layers=32,d=4096,blocks=16")
    routes = big["routes"]
    assert set(routes) == {"state", "features", "relay"}
    assert not routes["features"]["fits"] and routes["relay"]["fits"]
    assert routes["relay"]["largest_flops_per_step"] == routes["state"]["largest_flops_per_step"]
    assert big["recommended_route"] == "relay"
    tiny = plan_json(capsys, "--preset", "tiny", "--profile", "cpu")
    slower = (
        tiny["routes"]["relay"]["slowest_round_s"] > tiny["routes"]["features"]["slowest_round_s"]
    )
    assert slower and tiny["recommended_route"] == "features"
    assert plan_json(capsys, "--shape", "layers=32,d=4096,blocks=1")["recommended_route"] is None
