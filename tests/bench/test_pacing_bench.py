"""bench/pacing.py at its smoke setting: both runs, the JSON and the markdown section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_pacing_bench_smoke(corpus: Path, tmp_path: Path) -> None:
    out, md = tmp_path / "pacing.json", tmp_path / "BENCHMARKS.md"
    cmd = [
        sys.executable, str(ROOT / "bench" / "pacing.py"), "--smoke", "--threads", "1",
        "--data", str(corpus), "--out", str(out), "--benchmarks", str(md),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [run["pacing"] for run in r["runs"]] == ["fixed", "adaptive"]
    for run in r["runs"]:
        assert run["slow"]["workers"] == 1 and run["others"]["workers"] == 5
        assert run["protocol"]["pacing"] == run["pacing"]
        assert run["test_ce"] > 0
    text = md.read_text()
    assert "<!-- pacing:begin -->" in text and "| adaptive |" in text
    assert "`python bench/pacing.py --smoke" in text
