"""bench/report.py's shared files: benches running side by side each write their own section of
BENCHMARKS.md, and none may lose another's."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import report


def write_sections(path: Path, name: str, times: int, start: Any) -> None:
    """Write section NAME TIMES times; exit 1 as soon as one of its writes was lost."""
    start.wait()  # both writers past their imports before either writes
    for i in range(times):
        report.update_section(name, f"{name} {i}", path)
        with report.exclusive(path.name):
            if f"{name} {i}\n" not in path.read_text():  # the other wrote back a stale copy
                raise SystemExit(1)


def test_sections_written_at_once_by_two_processes_are_all_kept(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    writers = [
        ctx.Process(target=write_sections, args=(path, name, 300, start)) for name in ("one", "two")
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    assert [w.exitcode for w in writers] == [0, 0]
