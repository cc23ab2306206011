"""What a durable write of a pushed body costs the aggregator: `fsutil.atomic_write_bytes`
(temporary file, fsync, rename, fsync of the folder) of an fp16 delta of 1M parameters, through
the page cache and direct (O_DIRECT), interleaved round by round so that the machine's noise
hits both alike. As an aggregator's round does, a round writes 100 bodies under one folder and
removes them at its end (the commit). Wall and CPU (user + system) milliseconds a write, each
round's mean.

    python bench/durable_write.py                # 10 rounds of 100 writes a side, into a
                                                 # temporary folder
    python bench/durable_write.py --dir /data    # the file system an aggregator's state uses

Writes benchmarks/results/durable_write.json; docs/protocol.md ("State, crashes and
restarts") cites it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from blocktrain import fsutil
from report import machine, write_json

BODY_BYTES = 2_097_448  # bench/protocol_load.py's body: 1M fp16 values and their header


def timed(folder: Path, body: bytes, n: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds a durable write of `body` as a new file of `folder`, over n."""
    c0, t0 = os.times(), time.perf_counter()
    for i in range(n):
        fsutil.atomic_write_bytes(folder / f"{i}", body)
    c1, t1 = os.times(), time.perf_counter()
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return 1000 * (t1 - t0) / n, 1000 * cpu / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, help="where to write (default: a temporary folder)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--writes", type=int, default=100, help="writes a side and round")
    p.add_argument("--no-write", action="store_true", help="print only; write no JSON")
    args = p.parse_args()
    body = os.urandom(BODY_BYTES)
    direct_from = fsutil.DIRECT_FROM
    sides = {"page_cache": 1 << 62, "direct": direct_from}
    rows: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.rounds):
            for side, threshold in sides.items():
                fsutil.DIRECT_FROM = threshold
                folder = Path(tmp) / f"{side}{r}"
                rows[side].append(timed(folder, body, args.writes))
                for f in folder.iterdir():
                    f.unlink()
    fsutil.DIRECT_FROM = direct_from
    result = {
        "body_bytes": BODY_BYTES,
        "writes_per_round": args.writes,
        "sides": {
            side: {
                "wall_ms": [round(w, 2) for w, _ in vals],
                "cpu_ms": [round(c, 2) for _, c in vals],
                "median_wall_ms": round(statistics.median(w for w, _ in vals), 2),
                "median_cpu_ms": round(statistics.median(c for _, c in vals), 2),
                "mean_cpu_ms": round(statistics.fmean(c for _, c in vals), 2),
                "max_cpu_ms": round(max(c for _, c in vals), 2),
            }
            for side, vals in rows.items()
        },
        "machine": machine(),
    }
    for side, s in result["sides"].items():
        print(
            f"{side:10s} wall {s['median_wall_ms']:6.2f} ms, CPU median {s['median_cpu_ms']:.2f}, "
            f"mean {s['mean_cpu_ms']:.2f}, max {s['max_cpu_ms']:.2f} ms over {args.rounds} "
            f"rounds (each round's CPU a write: {s['cpu_ms']})"
        )
    if not args.no_write:
        print("wrote", write_json("durable_write.json", result))


if __name__ == "__main__":
    main()
