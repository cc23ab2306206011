"""bench/worker_costs.py: its committed figures are what the cost model computes now, and its
BENCHMARKS.md section is the one its JSON renders."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import worker_costs
from blocktrain.serving.host.shapes import parse_shape, shape_plan

ROOT = Path(__file__).resolve().parents[2]


def committed() -> dict:
    return dict(json.loads((ROOT / "benchmarks" / "results" / worker_costs.NAME).read_text()))


def test_the_committed_figures_are_the_cost_model_s() -> None:
    result = committed()
    for row in result["memory"]:
        for route, largest in row["largest_worker_bytes"].items():
            name, cfg = parse_shape(f"{row['shape']},route={route}")
            assert shape_plan(name, cfg)["worker_training_bytes"]["total"] == largest, row["shape"]
    for p in result["projection"]:
        again = worker_costs.projection(p["label"], p["shape"], result["local_steps"])
        for fresh, saved in zip(again["rows"], p["rows"], strict=True):
            for key, value in saved.items():  # floats through JSON: to their last digits
                want = pytest.approx(value, rel=1e-12) if isinstance(value, float) else value
                assert fresh[key] == want, (p["label"], saved["route"], key)


def test_the_section_is_the_json_rendered() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("<!-- worker-costs:begin -->\n", 1)[1].split(
        "\n<!-- worker-costs:end -->"
    )[0]
    assert section == worker_costs.markdown(committed()).strip()
