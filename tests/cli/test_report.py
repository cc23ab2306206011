"""`blocktrain report`: the plots and page of an aggregator state folder, a simulation, a cluster
output folder and a train run folder; the labels say what each number is, rounds are integers
on one axis, and the validation CE is plotted where the source has it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from blocktrain.cli.main import main
from blocktrain.protocol.store.history import REPORTED_LOSS, load
from tests.cli.test_cli import TINY, fails_cleanly
from tests.protocol.conftest import delta_body, make_harness


def two_rounds(tmp_path: Path):
    """A state folder (in `tmp_path`/state) where two blocks closed two rounds, and one push
    was refused; its harness, still open."""
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
    return h


def test_state_folder_report(capsys, tmp_path: Path) -> None:
    h = two_rounds(tmp_path)
    hist = load(h.state.root)
    curve = hist.model_curve()
    # after each round of the slowest block: the mean over blocks of each one's latest loss
    assert [c[0] for c in curve][-1] == 2
    assert curve[-1][3] == pytest.approx((1.5 + 2.5) / 2)
    assert curve[0][3] == pytest.approx((2.0 + 3.0) / 2)
    assert hist.accepted == 4 and sum(hist.refusals.values()) == 1
    # integer rounds on one axis: round r (status numbering) closes as the (r + 1)-th
    assert all(isinstance(c[0], int) for c in curve)
    assert hist.losses == {
        f"block 0: {REPORTED_LOSS}": [(1, 2.0), (2, 1.5)],
        f"block 1: {REPORTED_LOSS}": [(1, 3.0), (2, 2.5)],
    }
    # the sum is labelled as the sum, never as "training loss" nor as a validation CE
    assert "denoise + aux_weight x next-byte aux, summed" in hist.loss_label
    assert "training loss" not in hist.loss_label and not hist.evals

    out = tmp_path / "report"
    assert main(["report", str(h.state.root), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    names = {Path(p).name for p in printed}
    assert names == {"curves.png", "cost.png", "refusals.png", "index.html"}
    page = (out / "index.html").read_text()
    assert "<td>4</td>" in page  # accepted updates
    assert "denoise + aux_weight x next-byte aux, summed" in page
    assert "mean reported training loss" not in page and "validation CE" not in page
    assert "round r as the status numbers it (from 0) sits at r + 1" in page
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
    ((label, ce),) = hist.evals.items()
    assert label.startswith("validation from-noise CE") and [x for x, _ in ce] == [1, 2]
    page = (out / "index.html").read_text()
    assert "regime mild" in page and (out / "curves.png").is_file() and label in page
    fails_cleanly(capsys, ["report", str(sim), "--regime", "lan", "--out", str(out)], "no regime")


def test_cluster_folder_report(capsys, tmp_path: Path) -> None:
    """A cluster output folder: its state/ (the workers' reported losses) and the validation CE
    of each round's model from summary.json, after r rounds at x = r; before the evaluation has
    written summary.json, the losses alone."""
    h = two_rounds(tmp_path / "work")
    h.state.close()
    run = tmp_path / "c2"
    shutil.copytree(tmp_path / "work" / "state", run / "state")
    out = tmp_path / "report"
    assert main(["report", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    assert load(run).evals == {} and "none yet" in (out / "index.html").read_text()
    summary = {
        "rounds": 2,
        "from_noise_ce_per_round": [5.55, 3.1, 2.4],
        "sampler_ce_per_round": [5.5, 3.0, 2.3],
        "per_round_eval": {"bytes": 8192, "sweeps": 2, "split": "valid"},
        "final": {"sampler_ce": 2.25, "from_noise_ce": 2.38, "sweeps": 16, "bytes": 32768},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    hist = load(run)
    assert hist.kind == "cluster" and set(hist.losses) == {
        f"block {b}: {REPORTED_LOSS}" for b in (0, 1)
    }
    fn = "validation from-noise CE, 8192 bytes, M = 2 (nats/byte)"
    assert hist.evals[fn] == [(0, 5.55), (1, 3.1), (2, 2.4)]
    assert main(["report", str(run), "--out", str(out)]) == 0
    names = {Path(p).name for p in capsys.readouterr().out.split()}
    assert {"curves.png", "cost.png", "index.html"} <= names
    page = (out / "index.html").read_text()
    assert fn in page and "validation sampler CE, 8192 bytes, M = 2" in page
    assert "final validation sampler CE (M = 16)" in page and "2.2500 nats/byte" in page
    assert "5.550 at 0 -&gt; 2.400 at 2 (rounds closed)" in page


def test_train_folder_report(capsys, tmp_path: Path) -> None:
    """A train run folder: each block's denoise and aux CEs apart, by step, and the
    validation CE of its eval records; the summed `loss` is not plotted."""
    run = tmp_path / "small"
    run.mkdir()
    records = [
        {"event": "train", "step": 10, "loss": 9.0, "b0_loss": 9.5, "b0_loss_denoise": 4.5,
         "b0_loss_aux": 5.0, "b1_loss": 8.5, "b1_loss_denoise": 4.0, "b1_loss_aux": 4.5},
        {"event": "eval", "split": "valid", "step": 10, "from_noise_ce": 4.2, "sampler_ce": 4.1},
        {"event": "train", "step": 20, "loss": 7.0, "b0_loss": 7.5, "b0_loss_denoise": 3.5,
         "b0_loss_aux": 4.0, "b1_loss": 6.5, "b1_loss_denoise": 3.0, "b1_loss_aux": 3.5},
        {"event": "eval", "split": "valid", "step": 20, "from_noise_ce": 3.2, "sampler_ce": 3.0},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    hist = load(run)
    assert hist.kind == "train" and hist.x_label == "optimizer step" and hist.blocks == 2
    assert hist.losses["block 0: denoise loss (nats/byte)"] == [(10, 4.5), (20, 3.5)]
    assert hist.losses["block 1: next-byte aux CE, unweighted (nats/byte)"] == [
        (10, 4.5),
        (20, 3.5),
    ]
    assert len(hist.losses) == 4  # no sum among them
    assert hist.evals == {
        "validation from-noise CE (nats/byte)": [(10, 4.2), (20, 3.2)],
        "validation sampler CE (nats/byte)": [(10, 4.1), (20, 3.0)],
    }
    out = tmp_path / "report"
    assert main(["report", str(run), "--out", str(out)]) == 0
    names = {Path(p).name for p in capsys.readouterr().out.split()}
    assert names == {"curves.png", "index.html"}
    page = (out / "index.html").read_text()
    assert "x axis: optimizer steps" in page and "block 0: denoise loss" in page
    assert "validation sampler CE (nats/byte)" in page and "<td>20</td>" in page  # steps


def test_bad_sources_fail_cleanly(capsys, tmp_path: Path) -> None:
    fails_cleanly(
        capsys, ["report", str(tmp_path / "nope"), "--out", str(tmp_path)], "not a folder"
    )
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    out = tmp_path / "r"
    fails_cleanly(capsys, ["report", str(tmp_path / "junk"), "--out", str(out)], "none of")
    assert not out.exists(), "nothing written"
