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
    benchmarks = tmp_path / "BENCHMARKS.md"  # not the repository's: others may edit that one
    bench = [sys.executable, str(ROOT / "bench" / "gpu_quality.py")]
    cmd = [
        *bench,
        "--preset", "tiny",
        "--device", "cpu",
        "--steps", "20",  # not --budget: the step count must not depend on this CPU's speed
        "--test-bytes", "512",
        "--sweeps", "2",
        "--data", str(corpus),
        "--out", str(tmp_path),
        "--benchmarks", str(benchmarks),
        "--set", "d_model=32", "batch_size=2", "threads=1",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "gpu_quality.json").read_text())
    runs = result["runs"]
    assert set(runs) == {"blocktrain", "reference"}
    assert runs["blocktrain"]["steps"] == runs["reference"]["steps"] == 20
    for r in runs.values():
        assert r["bytes_per_second"] > 0 and r["train_flops_per_step"] > 0
        assert 0 < r["test_ce"] < 10
        assert r["peak_gpu_memory_bytes"] is None
    assert result["gap"] == runs["blocktrain"]["test_ce"] - runs["reference"]["test_ce"]
    assert runs["blocktrain"]["test"]["sweeps"] == 2
    assert not benchmarks.exists(), "a CPU run is a smoke test and never reaches the table"

    report = [*bench, "--report", "--out", str(tmp_path), "--benchmarks", str(benchmarks)]
    done = subprocess.run(report, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    section = benchmarks.read_text()
    assert "<!-- gpu-quality:begin -->" in section and "<!-- gpu-quality:end -->" in section
    assert f"| blocktrain | {runs['blocktrain']['test_ce']:.4f} |" in section, section


def test_gpu_quality_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_quality.py"), "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
    assert not (tmp_path / "gpu_quality.json").exists()
