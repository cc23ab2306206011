"""bench/cluster_small.py end to end at a tiny setting: the run is interrupted once its first
round has closed, the same command resumes it from there and evaluates the final model, and a
third invocation only reports. The full small run takes hours; this keeps its resume path
honest."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blocktrain.protocol.store.storage import StateDir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 6


def closed_rounds(work: Path) -> int:
    if not (work / "tokens.json").exists():  # written once the state folder is complete
        return 0
    state = StateDir(work / "state")
    try:
        return min(state.ledger.block_state(b)[1] for b in range(state.n_blocks()))
    finally:
        state.close()


def test_cluster_small_resumes_after_an_interrupt(corpus: Path, tmp_path: Path) -> None:
    work, out, md = tmp_path / "work", tmp_path / "cs.json", tmp_path / "BENCHMARKS.md"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "cluster_small.py"),
        "--preset", "tiny",
        "--rounds", str(ROUNDS),
        "--local-steps", "2",
        "--workers", "3",
        "--test-bytes", "512",
        "--sweeps", "2",
        "--data", str(corpus),
        "--work", str(work),
        "--out", str(out),
        "--benchmarks", str(md),
        "--set", "d_model=32", "batch_size=2", "seq_len=32",
    ]  # fmt: skip
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    limit = time.monotonic() + 180
    while closed_rounds(work) < 1:
        assert first.poll() is None, first.communicate()[1].decode()[-2000:]
        assert time.monotonic() < limit, "the first round did not close in 180 s"
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err.decode()[-2000:]
    assert "run the same command again to resume" in err.decode()
    (attempt,) = json.loads((work / "progress.json").read_text())
    assert not attempt["finished"]
    assert 1 <= attempt["ended_at_round"] < ROUNDS, attempt
    assert not out.exists()

    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert closed_rounds(work) == ROUNDS
    result = json.loads(out.read_text())
    assert [a["started_at_round"] for a in result["attempts"]] == [0, attempt["ended_at_round"]]
    assert result["attempts"][1]["finished"]
    assert math.isfinite(result["cluster_sampler_ce"]) and result["cluster_sampler_ce"] > 0
    single = json.loads((ROOT / "benchmarks/results/quality.json").read_text())["converged"]
    assert result["single_sampler_ce"] == single["blocktrain_sampler_ce"]
    assert result["comparable"] is False  # another preset and model than quality.json's
    assert 0 < result["participation_mean"] <= 1
    # at least one fp16 weights download and one fp16 delta upload per worker per round
    fp16 = 2 * sum(result["params_per_block"])  # one replica of each block: 3 workers
    assert result["bytes_down"] >= ROUNDS * fp16 and result["bytes_up"] >= ROUNDS * fp16
    assert result["bytes_total"] == result["bytes_down"] + result["bytes_up"]
    assert result["final"]["sweeps"] == 2
    assert "cluster-small:begin" in md.read_text() and "reputation at the end" in md.read_text()
    assert all(0 <= v <= 1 for v in result["reputation_final"].values())

    third = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    again = json.loads(out.read_text())
    assert len(again["attempts"]) == 2, "a finished run is not trained again"
    assert again["cluster_sampler_ce"] == result["cluster_sampler_ce"]  # the cached evaluation

    assert cmd[4] == "--rounds"
    other = [*cmd[:5], str(ROUNDS + 1), *cmd[6:]]  # another run in the same folder
    refused = subprocess.run(other, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert "holds another run" in refused.stderr and "Traceback" not in refused.stderr
