"""Byte counters per endpoint, block and worker, and the batched marks of pulls, kept in memory
between the aggregator's ticks and flushed to the ledger by them (a pull or a push pays for no
SQLite transaction of its own). Refused requests are counted in memory only, so a flood costs no
disk. The keys come from the aggregator, never from the request (NONE_KEY for a block not served
or a worker not authenticated), so a request cannot add rows to the traffic table."""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

from blocktrain.protocol.store.ledger import Ledger
from blocktrain.protocol.store.ledger_schema import NONE_KEY

SQLITE_MAX = 2**63 - 1
"""The largest integer a SQLite INTEGER column holds."""


class Traffic:
    """Thread-safe counters over one ledger."""

    def __init__(self, ledger: Ledger, blocks: Collection[int]) -> None:
        self.ledger = ledger
        self.blocks = frozenset(blocks)
        """The blocks served here; any other counts under NONE_KEY."""
        self._refused: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int, int], list[int]] = {}
        self._pulls: dict[int, tuple[int, float]] = {}
        """worker -> (round, time) of pulls not yet in the ledger."""

    def account(
        self, endpoint: str, block: int | None, worker: int | None, bytes_in: int, bytes_out: int
    ) -> None:
        # A path or a Content-Length header may claim any number; the ledger holds 64-bit
        # integers, and one row it cannot store would fail every flush after it.
        key = (
            endpoint,
            block if block in self.blocks else NONE_KEY,
            worker if worker is not None and 0 <= worker < SQLITE_MAX else NONE_KEY,
        )
        with self._lock:
            row = self._counts.setdefault(key, [0, 0, 0])
            row[0] += 1
            row[1] = min(row[1] + max(bytes_in, 0), SQLITE_MAX)
            row[2] = min(row[2] + bytes_out, SQLITE_MAX)

    def refused(self, endpoint: str, reason: str) -> None:
        with self._lock:
            self._refused[(endpoint, reason)] = self._refused.get((endpoint, reason), 0) + 1

    def refusals(self) -> dict[str, dict[str, int]]:
        """endpoint -> reason -> requests refused since the start."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for (endpoint, reason), n in sorted(self._refused.items()):
                out.setdefault(endpoint, {})[reason] = n
        return out

    def mark_pull(self, worker: int, round: int, now: float) -> None:
        with self._lock:
            self._pulls[worker] = (round, now)

    def flush(self) -> None:
        """Write the byte counters and the batched pull marks to the ledger."""
        with self._lock:
            rows = [(ep, b, w, v[0], v[1], v[2]) for (ep, b, w), v in self._counts.items()]
            self._counts = {}
            pulls, self._pulls = self._pulls, {}
        self.ledger.workers_pulled((w, r, now) for w, (r, now) in pulls.items())
        try:
            self.ledger.add_traffic(rows)
        except Exception:
            with self._lock:  # keep the counts for the next flush
                for ep, b, w, n, i, o in rows:
                    row = self._counts.setdefault((ep, b, w), [0, 0, 0])
                    row[0] += n
                    row[1] += i
                    row[2] += o
            raise

    def summary(self) -> dict[str, Any]:
        """Totals, and requests and bytes by endpoint, block and worker."""
        self.flush()
        by_endpoint: dict[str, dict[str, int]] = {}
        by_block: dict[str, dict[str, int]] = {}
        by_worker: dict[str, dict[str, int]] = {}
        total_in = total_out = 0
        for r in self.ledger.traffic():
            total_in += r["bytes_in"]
            total_out += r["bytes_out"]
            for table, key in (
                (by_endpoint, r["endpoint"]),
                (by_block, str(r["block"])),
                (by_worker, str(r["worker_id"])),
            ):
                if key == str(NONE_KEY) and table is not by_endpoint:
                    continue
                entry = table.setdefault(key, {"requests": 0, "bytes_in": 0, "bytes_out": 0})
                entry["requests"] += r["requests"]
                entry["bytes_in"] += r["bytes_in"]
                entry["bytes_out"] += r["bytes_out"]
        return {
            "bytes_in": total_in,
            "bytes_out": total_out,
            "total": total_in + total_out,
            "by_endpoint": by_endpoint,
            "by_block": by_block,
            "by_worker": by_worker,
        }
