"""bench/compose.py's reading: D compares the one-block, stack and deep-block rows on the seeds
they share, so a row measured on more seeds than the others cannot move D by their luck."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compose


def row(
    blocks: int, layers: int, ces: dict[int, float], model: str = "blocktrain"
) -> dict[str, Any]:
    route = "end-to-end" if model == "reference" else ("state" if blocks == 1 else "features")
    return {
        "preset": "small",
        "model": model,
        "blocks": blocks,
        "layers_per_block": layers,
        "route": route,
        "steps": 1000,
        "test_ce": sum(ces.values()) / len(ces),
        "by_seed": {
            str(s): {"test_ce": ce, "head_ce_per_block": [ce + 0.01]} for s, ce in ces.items()
        },
    }


def test_d_reads_every_row_on_the_seeds_they_share() -> None:
    one = row(1, 2, {0: 1.70, 1: 1.60})  # seed 1 is a lucky seed, measured for this row alone
    stack = row(3, 2, {0: 1.65})
    deep = row(1, 6, {0: 1.62})
    refs = [row(1, 2, {0: 1.80}, "reference"), row(1, 6, {0: 1.70}, "reference")]
    (d,) = compose.depth_delivered([one, stack, deep, *refs], "small")
    # on seed 0 alone: (1.70 - 1.65) / (1.70 - 1.62); the means over unmatched seeds would give
    # (1.65 - 1.65) / (1.65 - 1.62) = 0
    assert d["D"] == pytest.approx(0.05 / 0.08) and d["D_seeds"] == [0]
    assert d["D_reference"] == pytest.approx(0.05 / 0.10) and d["D_reference_seeds"] == [0]
    assert d["D_best_exit"] == pytest.approx(0.05 / 0.08)  # every head here is 0.01 worse


def test_d_is_not_read_without_a_shared_seed() -> None:
    rows = [row(1, 2, {1: 1.70}), row(3, 2, {0: 1.65}), row(1, 6, {0: 1.62})]
    (d,) = compose.depth_delivered(rows, "small")
    assert d["D"] is None and d["D_best_exit"] is None and d["D_seeds"] == []


def test_saving_a_row_keeps_the_other_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack's row saved into the JSON leaves the simulator's, HTTP and clock tables be."""
    written: dict[str, Any] = {}
    monkeypatch.setattr(compose, "write_json", lambda name, result: written.update(result))
    monkeypatch.setattr(compose, "update_section", lambda name, text: None)
    monkeypatch.setattr(compose, "markdown", lambda result: "")
    one = row(1, 2, {0: 1.7})
    old = {
        "rows": [],
        "commands": [],
        "head_to_head": [{"method": "m"}],
        "over_http": [{"workers": 3}],
        "clock": [{"method": "c"}],
    }
    args = compose.argparse.Namespace(bytes=32768)
    compose.save(old, {"k": one}, ["cmd"], args)
    assert written["rows"] == [one]
    assert written["clock"] == [{"method": "c"}]
    assert written["head_to_head"] == [{"method": "m"}]
    assert written["over_http"] == [{"workers": 3}]
