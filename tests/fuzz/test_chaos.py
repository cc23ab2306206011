"""bench/chaos.py end to end for one minute (slow, network): it runs, disturbs, and writes every
check and number it promises. Whether the checks pass is the benchmark's verdict, not this
test's; a run without root or iproute2 skips with the reason the bench gave."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_chaos_soak_writes_its_checks(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "chaos.json"
    flags = {
        "--minutes": "1",
        "--workers": "3",
        "--oversized-mb": "8",
        "--eval-bytes": "1024",
        "--data": str(corpus),
        "--out": str(out),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            *(x for kv in flags.items() for x in kv),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode == 2:
        pytest.skip(done.stderr.strip()[-300:])
    assert out.exists(), done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["checks"]) == {
        "ledger_consistent",
        "versions_monotonic",
        "rss_under_bound",
        "ce_within_noise",
        "rounds_closed",
    }
    assert result["passed"] == (done.returncode == 0)
    assert sum(result["faults"].values()) >= 3, result["faults"]
    assert result["status_samples"] > 10
    assert result["aggregator_peak_rss_mb"] > 0
