"""`blocktrain report`: the plots and page of an aggregator state folder and of a simulation."""

from __future__ import annotations

from pathlib import Path

import pytest

from blocktrain.cli.main import main
from blocktrain.protocol.store.history import load
from tests.cli.test_cli import TINY, fails_cleanly
from tests.protocol.conftest import delta_body, make_harness


def test_state_folder_report(capsys, tmp_path: Path) -> None:
    h = make_harness(tmp_path / "state")
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=1)["worker_id"]
    losses = {0: [2.0, 1.5], 1: [3.0, 2.5]}
    for rnd in range(2):
        for token, worker, block in ((h.alice, a, 0), (h.bob, b, 1)):
            assert h.pull(token, worker, block).status_code == 200
            body = delta_body(
                block, base_version=rnd, round=rnd, worker=worker, loss=losses[block][rnd]
            )
            assert h.push(token, worker, block, body).status_code == 200, "accepted"
        h.clock.advance(31.0)
        h.service.tick()
    bad = delta_body(0, base_version=0, round=0, worker=a)  # a round that has closed
    assert h.push(h.alice, a, 0, bad).status_code >= 400

    hist = load(h.state.root)
    curve = hist.model_curve()
    # after each round of the slowest block: the mean over blocks of each one's latest loss
    assert [c[0] for c in curve][-1] == 2
    assert curve[-1][3] == pytest.approx((1.5 + 2.5) / 2)
    assert curve[0][3] == pytest.approx((2.0 + 3.0) / 2)
    assert hist.accepted == 4 and sum(hist.refusals.values()) == 1

    out = tmp_path / "report"
    assert main(["report", str(h.state.root), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    names = {Path(p).name for p in printed}
    assert {"loss.png", "participation.png", "refusals.png", "block_loss.png"} <= names
    page = (out / "index.html").read_text()
    assert "<td>4</td>" in page  # accepted updates
    (reason,) = hist.refusals
    assert reason in page
    for name in names - {"index.html"}:
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    h.state.close()


def test_simulation_report(capsys, corpus: Path, tmp_path: Path) -> None:
    sim = tmp_path / "sim"
    argv = ["simulate", "--workers", "3", "--rounds", "2", "--regime", "lockstep,mild"]
    argv += ["--data", str(corpus), "--out", str(sim), "--seed", "4", "--no-progress", *TINY]
    argv += ["--local-steps", "2", "--eval-bytes", "256", "--final-bytes", "512"]
    assert main(argv) == 0
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["report", str(sim), "--regime", "mild", "--out", str(out)]) == 0
    hist = load(sim, "mild")
    assert hist.regime == "mild" and len(hist.model_curve()) == 2
    page = (out / "index.html").read_text()
    assert "regime mild" in page and (out / "loss.png").is_file()
    fails_cleanly(capsys, ["report", str(sim), "--regime", "lan", "--out", str(out)], "no regime")


def test_bad_sources_fail_cleanly(capsys, tmp_path: Path) -> None:
    fails_cleanly(
        capsys, ["report", str(tmp_path / "nope"), "--out", str(tmp_path)], "not a folder"
    )
    fails_cleanly(capsys, ["report", str(tmp_path), "--out", str(tmp_path / "r")], "neither")
