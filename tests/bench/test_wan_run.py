"""bench/wan_run.py end to end at a tiny setting: 3 host namespaces with delay, jitter and loss,
2 rounds, the per-round CE and bytes, both ends' byte counts, the final CE against a
single-process run. Needs root (skips otherwise), like tests/protocol/ops/test_netns.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_wan_run_smoke(corpus: Path, tmp_path: Path) -> None:
    out, md = tmp_path / "wan.json", tmp_path / "BENCHMARKS.md"
    cmd = [
        sys.executable, str(ROOT / "bench" / "wan_run.py"),
        "--rounds", "2", "--local-steps", "2",
        "--delay-ms", "30", "--jitter-ms", "10",
        "--eval-bytes", "512", "--final-bytes", "512", "--final-sweeps", "2",
        "--data", str(corpus), "--work", str(tmp_path / "work"),
        "--out", str(out), "--benchmarks", str(md),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode == 2 and "cannot build the namespaces" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert sorted(r["connect_ms"])[2] >= 2 * 20  # two one-way delays of at least 30 - 10 ms
    assert [x["round"] for x in r["rounds_log"]] == [0, 1, 2]
    assert all(math.isfinite(x["sampler_ce"]) for x in r["rounds_log"])
    assert (r["updates"]["accepted"], r["updates"]["refused"]) == (2 * 6, 0)
    for x in r["rounds_log"][1:]:
        assert all(b["accepted"] == b["expected"] == 2 for b in x["blocks"].values())
        assert x["bytes_by_endpoint"]["push"]["bytes_in"] > 0
    hosts = {k: v for k, v in r["bytes_by_host"].items() if k != "unattributed"}
    assert sorted(hosts) == ["h1", "h2", "h3"]
    for h in hosts.values():  # each host's pushes counted alike at both ends, whatever was lost
        assert len(h["workers"]) == 2
        assert h["aggregator_push_bytes_in"] == h["workers_bytes_up"] > 0
    # and every body byte the workers received, from the ledger's rows of every block
    every = r["bytes_by_host"].values()
    assert sum(h["aggregator_bytes_out"] for h in every) == sum(
        h["workers_bytes_down"] for h in every
    )
    assert r["bytes"]["total"] >= r["bytes"]["minimum"] > 0
    assert math.isfinite(r["wan_sampler_ce"]) and math.isfinite(r["single_sampler_ce"])
    assert "wan-run:begin" in md.read_text()
