"""bench/equivalence.py's comparison of two revisions' outputs, without running them: which
differences count, and the weight gap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import equivalence


def test_wall_clock_keys_do_not_count_and_decisions_do() -> None:
    before = {"rounds": [{"accepted": 2, "refused": {"late": 1}, "wall_s": 3.1}], "compute": {}}
    after = {
        "rounds": [{"accepted": 2, "refused": {"late": 1}, "wall_s": 9.7}],
        "compute": {"x": 1},
    }
    assert equivalence.differences(before, after) == []
    after["rounds"][0]["refused"] = {"harmful": 1}
    assert equivalence.differences(before, after) == [
        ".rounds[0].refused.harmful: only on one side",
        ".rounds[0].refused.late: only on one side",
    ]
    assert equivalence.differences({"ce": 2.0}, {"ce": 2.0000001}) == [".ce: 2.0 != 2.0000001"]
    assert equivalence.differences([1, 2], [1]) == [".: [1, 2] != [1]"]


def test_a_revisions_folders_and_ports_are_named_alike() -> None:
    value = {"out": "/w/runs/before-abc/sim", "url": "http://127.0.0.1:4312/v1"}
    assert equivalence.neutral(value, {"/w/runs/before-abc": "RUNS"}) == {
        "out": "RUNS/sim",
        "url": "http://127.0.0.1:PORT/v1",
    }


def test_the_weight_gap_over_every_saved_tensor(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root, bump in ((a, 0.0), (b, 0.25)):
        (root / "lockstep").mkdir(parents=True)
        save_file(
            {"w": torch.ones(3), "v": torch.zeros(2) + bump},
            root / "lockstep" / "weights.safetensors",
        )
    assert equivalence.tensor_gap(a, a) == 0.0
    assert equivalence.tensor_gap(a, b) == pytest.approx(0.25)
    save_file({"w": torch.ones(4)}, b / "extra.safetensors")
    assert equivalence.tensor_gap(a, b) == float("inf")  # the files differ
    assert equivalence.tensor_gap(tmp_path / "none", tmp_path / "none") == float("inf")
