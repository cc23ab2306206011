"""bench/compression.py's reading of its rows, without a simulation: which rows a table compares,
each wire's spread against fp16 of the same seed, the verdicts, and the ablations' variants."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compression
from blocktrain.protocol.core import round_engine
from blocktrain.protocol.core.settings import AggregatorSettings


def row(
    wire: str,
    seed: int,
    ce: float,
    total: int,
    *,
    variant: str = "",
    rounds: int = 30,
    preset: str | None = None,
    route: str | None = None,
) -> dict[str, Any]:
    return {
        **({} if preset is None else {"preset": preset}),  # None: a row from before --preset
        **({} if route is None else {"route": route}),  # None: a row from before --route
        "wire": wire,
        "variant": variant,
        "seed": seed,
        "rounds": rounds,
        "local_steps": 30,
        "pull_wire": compression.pull_wire(wire),
        "final_sampler_ce": ce,
        "bytes_total": total,
        "bytes_up": total // 3,
        "bytes_down": total - total // 3,
        "accepted": 10,
        "refused": {},
    }


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return compression.result_of({compression.key_of(r): r for r in rows})


def test_spread_and_verdicts_against_fp16_of_the_same_seed() -> None:
    rows = [row("fp16", s, 2.0 + 0.1 * s, 1000) for s in (0, 1, 2)]
    rows += [
        row("sparse:0.03:2", s, 2.0 + 0.1 * s + d, 50) for s, d in [(0, 0.01), (1, 0.02), (2, 0.03)]
    ]
    rows += [row("sparse:0.01:2", s, 2.0 + 0.1 * s + 0.005, 20) for s in (0, 1, 2)]
    rows += [row("int8", 0, 2.5, 540)]
    result = table(rows)
    sparse = result["seeds"]["sparse:0.03:2"]
    assert sparse["seeds"] == [0, 1, 2]
    assert sparse["ce_vs_fp16_mean"] == pytest.approx(0.02)
    assert sparse["ce_vs_fp16_se"] == pytest.approx(0.01 / 3**0.5)
    assert sparse["bytes_vs_fp16_mean"] == pytest.approx(0.05)
    assert sparse["verdict"].startswith("bar (CE +0.03, bytes ≤ 0.1) met; goal")
    assert sparse["verdict"].endswith("not met")
    assert result["seeds"]["sparse:0.01:2"]["verdict"].endswith("goal (CE +0.01, bytes ≤ 0.03) met")
    assert result["seeds"]["int8"]["verdict"] == "needs 3 seeds"  # one seed: no verdict
    assert result["rows"][0]["wire"] == "fp16"
    assert all(r["seed"] == 0 for r in result["rows"])


def test_the_tables_compare_the_longest_fp16_run_and_keep_the_rest() -> None:
    short = [row("fp16", 0, 2.9, 100, rounds=10), row("int8", 0, 2.85, 54_000_000, rounds=10)]
    long = [row("fp16", 0, 2.0, 500), row("sparse:0.03:2", 0, 2.01, 25)]
    result = table(short + long)
    assert {r["wire"] for r in result["rows"]} == {"fp16", "sparse:0.03:2"}
    assert {(r["wire"], r["rounds"]) for r in result["other_rows"]} == {("fp16", 10), ("int8", 10)}
    assert result["command"] == (
        "python bench/compression.py --rounds 30 --local-steps 30 --route features"
    )
    text = compression.shorter_markdown(result)  # docs/research/compression.md's table
    assert "| 10 x 30 | int8 | — | 0 | 2.8500 | 54.0 MB |" in text
    assert "10 x 30" not in compression.markdown(result)


def test_traffic_counts_the_relayed_streams_apart_and_the_codec_leaves_them() -> None:
    """A timing-only run per route: the streams are relay's alone, the delta codec shrinks
    pushes and pulls but not them, and each total is read against fp16 of its route."""
    rows = [
        compression.traffic_row("tiny", route, wire, rounds=2, local_steps=3)
        for route in ("state", "relay")
        for wire in ("fp16", "sparse:0.03:2")
    ]
    by = {(r["route"], r["wire"]): r for r in rows}
    for r in rows:
        assert r["bytes_total"] == r["bytes_pushed"] + r["bytes_pulled"] + r["bytes_streams"]
    assert by["state", "fp16"]["bytes_streams"] == 0 < by["relay", "fp16"]["bytes_streams"]
    assert by["relay", "sparse:0.03:2"]["bytes_streams"] == by["relay", "fp16"]["bytes_streams"]
    assert by["relay", "sparse:0.03:2"]["bytes_pushed"] < by["relay", "fp16"]["bytes_pushed"] / 10
    text = compression.traffic_markdown(rows)
    ratio = by["relay", "sparse:0.03:2"]["bytes_total"] / by["relay", "fp16"]["bytes_total"]
    assert "| tiny | relay | sparse:0.03:2 |" in text and f"| {ratio:.3f} |" in text
    two = compression.traffic_row("tiny", "relay", "sparse:0.03:2", 2, 3, relay_bits=2)
    # a 2-bit stream: a token's d / 4 bytes of features and its 5 bytes more, against d + 5
    d = 128
    want = by["relay", "fp16"]["bytes_streams"] * (d // 4 + 5) / (d + 5)
    assert abs(two["bytes_streams"] - want) < 0.01 * want
    assert "| tiny | relay | sparse:0.03:2, 2-bit streams |" in compression.traffic_markdown(
        [*rows, two]
    )


def test_another_presets_rows_are_a_pair_read_against_their_own_fp16() -> None:
    tiny = [row("fp16", 0, 2.0, 500), row("sparse:0.03:2", 0, 2.01, 25, preset="tiny")]
    small = [
        row("sparse:0.03:2", 0, 1.72, 40, rounds=20, preset="small"),
        row("fp16", 0, 1.70, 800, rounds=20, preset="small"),
        row("sparse:0.03:2", 1, 1.75, 40, rounds=20, preset="small"),  # no fp16 of seed 1
    ]
    result = table(tiny + small)
    assert [r["wire"] for r in result["rows"]] == ["fp16", "sparse:0.03:2"]  # tiny's alone
    assert result["rows"][1]["ce_vs_fp16"] == pytest.approx(0.01)
    pairs = result["preset_rows"]
    assert [(r["seed"], r["wire"]) for r in pairs] == [
        (0, "fp16"),
        (0, "sparse:0.03:2"),
        (1, "sparse:0.03:2"),
    ]
    assert pairs[1]["ce_vs_fp16"] == pytest.approx(0.02)
    assert pairs[1]["bytes_vs_fp16"] == pytest.approx(0.05)
    assert pairs[2]["ce_vs_fp16"] is None
    text = compression.markdown(result)
    assert (
        "| small | features | 20 x 30 | 0 | sparse:0.03:2 | sparse:0.06:4 | — | 1.7200 | +0.0200 |"
        in text
    )


def test_a_row_of_another_route_is_read_against_fp16_of_its_route() -> None:
    # rows from before --route ran under features (the main tables); relay rows pair apart
    rows = [row("fp16", 0, 2.0, 500), row("sparse:0.03:2", 0, 2.01, 25)]
    rows += [
        row("fp16", 0, 1.9, 2000, route="relay"),
        row("sparse:0.03:2", 0, 1.95, 1600, route="relay"),
    ]
    result = table(rows)
    assert [r["wire"] for r in result["rows"]] == ["fp16", "sparse:0.03:2"]
    assert result["rows"][1]["ce_vs_fp16"] == pytest.approx(0.01)
    relay = [r for r in result["preset_rows"] if r.get("route") == "relay"]
    assert [r["wire"] for r in relay] == ["fp16", "sparse:0.03:2"]
    assert relay[1]["ce_vs_fp16"] == pytest.approx(0.05)
    assert relay[1]["bytes_vs_fp16"] == pytest.approx(0.8)
    assert "| tiny | relay | 30 x 30 | 0 | sparse:0.03:2 |" in compression.markdown(result)
    assert compression.key_of(rows[0])[6] == "features"


def test_an_fp16_row_with_a_variant_is_a_control_read_against_plain_fp16() -> None:
    momentum = "outer_lr=0.7,outer_momentum=0.9"
    rows = [row("fp16", s, 2.0 + 0.1 * s, 1000) for s in (0, 1)]
    rows += [row("fp16", s, 2.05 + 0.1 * s, 1000, variant=momentum) for s in (0, 1)]
    result = table(rows)
    control = next(r for r in result["rows"] if r["variant"])
    assert control["ce_vs_fp16"] == pytest.approx(0.05)
    assert result["seeds"][f"fp16 [{momentum}]"]["ce_vs_fp16"] == pytest.approx([0.05, 0.05])
    assert "fp16" not in result["seeds"]  # the reference is not read against itself


def test_a_saved_result_gives_back_every_row_it_holds() -> None:
    rows = [row("fp16", s, 2.0, 1000) for s in (0, 1)] + [row("fp16", 0, 2.9, 100, rounds=10)]
    rows += [row("fp16", 0, 1.7, 800, preset="small"), row("int8", 0, 1.8, 400, preset="small")]
    rows += [row("sparse:0.03:2", 0, 2.01, 25, variant="exact_pulls=off")]
    saved = table(rows)
    assert sum(len(saved[name]) for name in compression.ROW_LISTS) == len(rows)
    back = compression.saved_rows(saved)
    assert set(back) == {compression.key_of(r) for r in rows}  # the small pair too


def test_variants_name_settings_or_the_dense_mean() -> None:
    assert compression.variant_settings("") == ({}, False)
    assert compression.variant_settings("outer_lr=0.7,outer_momentum=0.9") == (
        {"outer_lr": 0.7, "outer_momentum": 0.9},
        False,
    )
    assert compression.variant_settings("mean=dense") == ({}, True)
    for bad in ("mean=sparse", "outer_lr", "no_such_setting=1"):
        with pytest.raises(ValueError):
            compression.variant_settings(bad)
    for wire, variant in compression.ABLATIONS:  # every ablation is one the bench can run
        compression.variant_settings(variant)
        compression.design(wire, variant)
    assert "dense mean" in compression.design("sparse:0.03:2", "mean=dense")
    assert "per-coordinate mean" in compression.design("sparse:0.03:2", "")
    # the streams' codec is the run's config, not an aggregator setting
    variant = "relay_bits=2,relay_every=3,outer_lr=0.5"
    assert compression.variant_settings(variant) == ({"outer_lr": 0.5}, False)
    assert compression.variant_overrides(variant) == ["relay_bits=2", "relay_every=3"]
    assert "streams 2-bit; one step in 3 relayed" in compression.design("sparse:0.03:2", variant)


def test_the_dense_mean_ablation_patches_the_engine_and_restores_it() -> None:
    settings = AggregatorSettings(delta_wire="sparse:0.03:2")
    assert round_engine.accumulator(settings).per_coordinate
    with compression.dense_mean_of_sparse(True):
        assert not round_engine.accumulator(settings).per_coordinate
    assert round_engine.accumulator(settings).per_coordinate
