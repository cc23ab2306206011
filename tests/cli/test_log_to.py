"""`train --log-to`: the records of metrics.jsonl, also in TensorBoard event files (and W&B or
MLflow, offline, where those libraries are installed); a missing library is one line before
anything is written."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from blocktrain.cli.cluster_eval import evaluation_records, round_records
from blocktrain.cli.main import main
from blocktrain.protocol.http.status import round_record
from blocktrain.training.checkpoint import iter_metrics
from blocktrain.training.tracking import Tracking, scalars

from .test_cli import TINY, fails_cleanly

TRAIN = [*TINY, "--set", "eval_every=2"]


def read_events(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], list[int]]:
    """Every scalar of the TensorBoard event files in `folder` (TFRecord framing: length, its
    CRC, an Event proto, its CRC), by tag, and the steps of the purge markers (SessionLog
    START) a resumed writer leaves."""
    from tensorboardX.proto import event_pb2

    tags: dict[str, list[tuple[int, float]]] = {}
    purges: list[int] = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                purges.append(event.step)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    tags.setdefault(value.tag, []).append((event.step, value.simple_value))
    return tags, purges


def test_tensorboard_gets_the_metrics_of_metrics_jsonl(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--out", str(run), "--steps", "3", *TRAIN]
    assert main([*argv, "--log-to", "tensorboard"]) == 0
    tags, purges = read_events(run / "tensorboard")
    records = list(iter_metrics(run))
    trains = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    assert [s for s, _ in tags["train/loss"]] == [1, 2, 3]
    assert [v for _, v in tags["train/loss"]] == pytest.approx([r["loss"] for r in trains])
    assert [s for s, _ in tags["valid/sampler_ce"]] == [r["step"] for r in evals] == [2, 3]
    assert [v for _, v in tags["valid/sampler_ce"]] == pytest.approx(
        [r["sampler_ce"] for r in evals]
    )
    assert "train/b0_loss" in tags and "valid/ce_per_step/0" in tags and not purges

    resume = ["train", "--resume", "--data", str(corpus), "--out", str(run), "--steps", "4"]
    assert main([*resume, "--no-progress", "--log-to", "tensorboard"]) == 0
    tags, purges = read_events(run / "tensorboard")
    assert purges == [4], "a resumed writer drops what was logged after its checkpoint"
    assert [s for s, _ in tags["train/loss"]] == [1, 2, 3, 4]


def test_a_missing_library_stops_before_anything_is_written(tmp_path, corpus, capsys, monkeypatch):
    for module in ("wandb", "mlflow", "mlflow.tracking", "tensorboardX", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError
    run = tmp_path / "run"
    base = ["train", "--data", str(corpus), "--out", str(run), *TINY]
    for backend, pip in (
        ("tensorboard", "pip install tensorboardX"),
        ("wandb", "pip install wandb"),
        ("mlflow", "pip install mlflow-skinny"),
    ):
        fails_cleanly(capsys, [*base, "--log-to", backend], pip)
        assert not run.exists(), backend
    fails_cleanly(capsys, [*base, "--log-to", "tensorboard,wandb"], "pip install tensorboardX")
    fails_cleanly(capsys, ["distill", "--out", str(run), "--log-to", "wandb"], "pip install wandb")
    fails_cleanly(capsys, [*base, "--log-to", "comet"], "choose from tensorboard, wandb, mlflow")
    assert not run.exists()
    # cluster, worker and join read --log-to in the same place, before anything else
    cluster = ["cluster", "--workers", "2", "--rounds", "1", "--data", str(corpus)]
    fails_cleanly(capsys, [*cluster, "--out", str(run), "--log-to", "mlflow"], "pip install mlflow")
    worker = ["worker", "--aggregator", "http://127.0.0.1:9", "--state", str(run)]
    fails_cleanly(capsys, [*worker, "--log-to", "wandb"], "pip install wandb")
    join = ["join", "http://127.0.0.1:9", "--state", str(run), "--log-to", "tensorboard"]
    fails_cleanly(capsys, join, "pip install tensorboardX")
    assert not run.exists()


def test_records_become_named_scalars():
    step, values = scalars(
        {
            "event": "eval",
            "split": "valid",
            "step": 7,
            "sampler_ce": 2.5,
            "ce_per_step": [3.0, 2.5],
            "block0": {"oracle_ce": 2.25},
            "sampler": "euler",
            "oracle_ce": None,
            "flag": True,
            "bad": float("nan"),
        }
    )
    assert step == 7
    assert values == {
        "valid/sampler_ce": 2.5,
        "valid/ce_per_step/0": 3.0,
        "valid/ce_per_step/1": 2.5,
        "valid/block0/oracle_ce": 2.25,
    }
    assert scalars({"event": "train", "step": 1, "loss": 5.0}) == (1, {"train/loss": 5.0})


def test_mlflow_file_store_under_the_run(tmp_path, corpus, capsys, monkeypatch):
    pytest.importorskip("mlflow")  # not in the dev extras: mlflow-skinny pulls ~20 packages
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--out", str(run), "--steps", "3", *TRAIN]
    assert main([*argv, "--log-to", "mlflow"]) == 0
    run_id = json.loads((run / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    history = client.get_metric_history(run_id, "train/loss")
    trains = [r for r in iter_metrics(run) if r["event"] == "train"]
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in trains])
    assert client.get_run(run_id).data.params["model.d_model"] == "32"


def test_wandb_offline_run_under_the_run(tmp_path, corpus, capsys, monkeypatch):
    pytest.importorskip("wandb")  # not in the dev extras: heavy, with a binary of its own
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--out", str(run), "--steps", "2", *TRAIN]
    assert main([*argv, "--log-to", "wandb"]) == 0
    run_id = json.loads((run / "tracking.json").read_text())["wandb"]
    (offline,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    assert any(offline.glob("*.wandb"))


def test_a_clusters_rounds_and_evaluations_become_scalars(tmp_path):
    """`cluster --log-to` (issue 30): each committed round the status lists, once, with the
    loss its updates reported, at step = the rounds done; then the summary's evaluations."""

    def row(r: int) -> dict:
        return round_record(
            {"round": r, "accepted": 2, "in_time": 1, "refused": 1, "expected": 2, "reported": 3,
             "cause": "deadline", "held": None, "new_version": r + 1, "started_at": 10.0 * r,
             "closed_at": 10.0 * r + 4.5}
        )  # fmt: skip

    asked: list[int] = []

    def losses() -> dict:
        asked.append(1)
        return {(0, 0): 5.5, (0, 1): 5.25, (1, 0): 5.0}

    tracking = Tracking(["tensorboard"], tmp_path / "out", {"seed": 1})
    logged: dict[str, int] = {}
    polls = [{"0": [row(0)]}, {"0": [row(0)], "1": []}, {"0": [row(0), row(1)], "1": [row(0)]}]
    for participation in polls:  # the second poll sees no new round: nothing logged, nor asked
        for record in round_records({"participation": participation}, logged, losses):
            tracking.log(record)
    summary = {
        "rounds": 2,
        "from_noise_ce_per_round": [5.5, 5.0, 4.75],
        "sampler_ce_per_round": [5.25, 4.5, 4.25],
        "final": {"sampler_ce": 4.0, "ce_per_step": [4.5, 4.0], "oracle_ce": None, "sweeps": 16},
    }
    for record in evaluation_records(summary):
        tracking.log(record)
    tracking.close()
    assert len(asked) == 2 and logged == {"0": 1, "1": 0}
    tags, _ = read_events(tmp_path / "out" / "tensorboard")
    assert tags["rounds/block0/accepted"] == [(1, 2.0), (2, 2.0)]
    assert tags["rounds/block0/participation"] == [(1, 0.5), (2, 0.5)]
    assert tags["rounds/block0/duration_s"] == [(1, 4.5), (2, 4.5)]
    assert tags["rounds/block0/loss"] == [(1, 5.5), (2, 5.25)]
    assert tags["rounds/block1/version"] == [(1, 1.0)]
    assert tags["valid/from_noise_ce"] == [(0, 5.5), (1, 5.0), (2, 4.75)]
    assert tags["valid/sampler_ce"] == [(0, 5.25), (1, 4.5), (2, 4.25)]
    assert tags["final/sampler_ce"] == [(2, 4.0)] and tags["final/ce_per_step/1"] == [(2, 4.0)]
    assert "final/sweeps" not in tags and "final/oracle_ce" not in tags
