"""bench/gpu_quality.py runs on a lent GPU with minutes to spare: a CPU smoke run here keeps it
from breaking where nobody can try it cheaply."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_quality_smoke_on_cpu(corpus: Path, tmp_path: Path) -> None:
    before = (ROOT / "BENCHMARKS.md").read_text()
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "gpu_quality.py"),
        "--preset", "tiny",
        "--device", "cpu",
        "--budget", "0.1",
        "--test-bytes", "512",
        "--sweeps", "2",
        "--data", str(corpus),
        "--out", str(tmp_path),
        "--set", "d_model=32", "batch_size=2", "threads=1",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "gpu_quality.json").read_text())
    runs = result["runs"]
    assert set(runs) == {"blocktrain", "reference"}
    assert runs["blocktrain"]["steps"] == runs["reference"]["steps"] == 20  # the floor
    for r in runs.values():
        assert r["bytes_per_second"] > 0 and r["train_flops_per_step"] > 0
        assert 0 < r["test_ce"] < 10
        assert r["peak_gpu_memory_bytes"] is None
    assert result["gap"] == runs["blocktrain"]["test_ce"] - runs["reference"]["test_ce"]
    assert runs["blocktrain"]["test"]["sweeps"] == 2
    assert (ROOT / "BENCHMARKS.md").read_text() == before  # CPU runs never reach the table


def test_gpu_quality_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_quality.py"), "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
    assert not (tmp_path / "gpu_quality.json").exists()
