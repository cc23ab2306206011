"""The ledger: one SQLite file recording tokens (hashed), workers, each block's committed state,
every closed round, every update's fate, the bytes moved and each identity's reputation: the
aggregator's source of truth across restarts. An update is acknowledged as accepted only once
its row is durable (and its body fsynced); a commit marks its accepted updates with their
version in one transaction. WAL journal, fsynced after every transaction but an accepted
update's (the service fsyncs it outside its lock); writes share one connection behind a lock."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blocktrain.protocol.store import ledger_counts
from blocktrain.protocol.store.ledger_recovery import RecoveryTables
from blocktrain.protocol.store.ledger_schema import (
    SCHEMA,
    Readers,
    UpdateRow,
    WorkerRow,
    connect,
    fsync_wal,
    migrate,
)

BLOCKS = "SELECT block FROM blocks ORDER BY block"


class Ledger(RecoveryTables):
    """Typed access to the ledger file. Every method is one transaction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = connect(self.path, writer=True)
        with self._lock:
            self._db.executescript(SCHEMA)
        with self._tx() as db:
            migrate(db)  # a ledger of an earlier schema
            self._counts = ledger_counts.load(db)
        self._readers = Readers(self.path)

    def close(self) -> None:
        self._readers.close()
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self, sync: bool = True) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            if sync:
                fsync_wal(self.path)

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, tuple(args)))

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        return self._readers.query(sql, tuple(args))

    # ------------------------------------------------------------------ workers

    def add_worker(self, token_id: int, block: int, name: str | None, now: float) -> int:
        with self._tx() as db:
            (next_id,) = db.execute("SELECT COALESCE(MAX(id) + 1, 0) FROM workers").fetchone()
            db.execute(
                "INSERT INTO workers (id, token_id, name, block, registered, last_seen) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (next_id, token_id, name, block, now, now),
            )
            return int(next_id)

    def revive_worker(self, worker_id: int, name: str | None, now: float) -> int:
        """Take a worker back under its own id (a restarted worker that resumes its folder,
        `protocol.worker.resume`): registered again, whether it left or timed out; its name
        changes only when one is given."""
        with self._tx() as db:
            db.execute(
                "UPDATE workers SET left_at = NULL, last_seen = MAX(last_seen, ?), "
                "name = COALESCE(?, name) WHERE id = ?",
                (now, name, worker_id),
            )
        return worker_id

    def worker(self, worker_id: int) -> WorkerRow | None:
        if not 0 <= worker_id < 2**63:  # an id from a request: SQLite cannot even compare it
            return None
        rows = self._read("SELECT * FROM workers WHERE id = ?", (worker_id,))
        return WorkerRow(**dict(rows[0])) if rows else None

    def workers(self, *, active_only: bool = True) -> list[WorkerRow]:
        sql = "SELECT * FROM workers" + (" WHERE left_at IS NULL" if active_only else "")
        return [WorkerRow(**dict(r)) for r in self._query(sql + " ORDER BY id")]

    def latest_worker_of(self, token_id: int) -> WorkerRow | None:
        rows = self._read(
            "SELECT * FROM workers WHERE token_id = ? AND left_at IS NULL ORDER BY id DESC LIMIT 1",
            (token_id,),
        )
        return WorkerRow(**dict(rows[0])) if rows else None

    def round_started(self, block: int, round: int, started_at: float) -> None:
        """The first pull of a round: its deadline clock, which a restart must keep."""
        with self._tx() as db:
            db.execute(
                "UPDATE blocks SET started_at = ? WHERE block = ? AND round = ?",
                (started_at, block, round),
            )

    def workers_pulled(self, marks: Iterable[tuple[int, int, float]]) -> None:
        """(worker, round, time) of pulls, written in one transaction (the aggregator batches
        them: who pulled only tells a restarted aggregator whom to wait for)."""
        marks = list(marks)
        if marks:
            with self._tx() as db:
                db.executemany(
                    "UPDATE workers SET pulled_round = ?, last_seen = MAX(last_seen, ?)"
                    " WHERE id = ?",
                    [(r, now, w) for w, r, now in marks],
                )

    def worker_left(self, worker_id: int, now: float) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE workers SET left_at = ? WHERE id = ? AND left_at IS NULL", (now, worker_id)
            )

    # ------------------------------------------------------------------ blocks and rounds

    def init_blocks(self, n_blocks: int) -> None:
        with self._tx() as db:
            for b in range(n_blocks):
                db.execute("INSERT OR IGNORE INTO blocks VALUES (?, 0, 0, NULL)", (b,))

    def block_state(self, block: int) -> tuple[int, int, float | None]:
        """(version, round, started_at) of the open round."""
        rows = self._query(
            "SELECT version, round, started_at FROM blocks WHERE block = ?", (block,)
        )
        if not rows:
            raise KeyError(block)
        return int(rows[0]["version"]), int(rows[0]["round"]), rows[0]["started_at"]

    def commit_round(
        self,
        *,
        block: int,
        round: int,
        base_version: int,
        new_version: int,
        started_at: float | None,
        deadline: float | None,
        closed_at: float,
        cause: str,
        refused: int,
        expected: int,
        reported: int,
        update_ids: list[int],
        held: str = "",
    ) -> None:
        """Close a round: its row, the block's new state, and the version each accepted update
        went into, atomically. `held`: why the rule refused to aggregate, if it did."""
        with self._tx() as db:
            tokens = 0
            for uid in update_ids:
                row = db.execute("SELECT tokens FROM updates WHERE id = ?", (uid,)).fetchone()
                tokens += int(row["tokens"] or 0) if row else 0
            db.execute(
                "INSERT INTO rounds (block, round, base_version, new_version, started_at, "
                "deadline, closed_at, cause, accepted, refused, expected, reported, tokens, held) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    block,
                    round,
                    base_version,
                    new_version,
                    started_at,
                    deadline,
                    closed_at,
                    cause,
                    len(update_ids),
                    refused,
                    expected,
                    reported,
                    tokens,
                    held or None,
                ),
            )
            db.execute(
                "UPDATE blocks SET version = ?, round = ?, started_at = NULL WHERE block = ?",
                (new_version, round + 1, block),
            )
            db.executemany(
                "UPDATE updates SET committed_version = ?, committed_at = ?, "
                "pending = NULL WHERE id = ?",
                [(new_version, closed_at, uid) for uid in update_ids],
            )

    def rounds(self, block: int | None = None, *, last: int | None = None) -> list[dict[str, Any]]:
        """Closed rounds, each with `in_time`: its accepted updates of the round itself (the
        numerator of its participation; `accepted` also counts updates counted in it late).
        With `last`, the last rounds of each block only, read through the primary key: the cost
        does not grow with the run's length."""
        sql = (
            "SELECT r.*, (SELECT COUNT(*) FROM updates u WHERE u.block = r.block "
            "AND u.round = r.round AND u.counts_in = r.round AND u.fate = 'accepted') AS in_time "
            "FROM rounds r"
        )
        if last is None:
            where = " WHERE r.block = ?" if block is not None else ""
            args = () if block is None else (block,)
            return [dict(r) for r in self._query(sql + where + " ORDER BY r.block, r.round", args)]
        blocks = [block] if block is not None else [r[0] for r in self._query(BLOCKS)]
        rows: list[dict[str, Any]] = []
        for b in blocks:
            recent = self._query(
                sql + " WHERE r.block = ? ORDER BY r.round DESC LIMIT ?", (b, last)
            )
            rows += [dict(r) for r in reversed(recent)]
        return rows

    # ------------------------------------------------------------------ updates

    def record_update(
        self,
        *,
        received: float,
        bytes: int,
        fate: str,
        token_id: int | None,
        worker_id: int | None,
        block: int | None,
        round: int | None = None,
        base_version: int | None = None,
        tokens: int | None = None,
        loss: float | None = None,
        norm: float | None = None,
        reason: str | None = None,
        detail: str | None = None,
        weight: float | None = None,
        counts_in: int | None = None,
        pending: str | None = None,
        seen: float | None = None,
        sync: bool = True,
    ) -> int:
        with self._lock:  # the in-memory counters change with the committed row
            with self._tx(sync) as db:
                cur = db.execute(
                    "INSERT INTO updates (received, token_id, worker_id, block, round, base_version,"
                    " tokens, loss, norm, bytes, fate, reason, detail, weight, counts_in, pending) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        received,
                        token_id,
                        worker_id,
                        block,
                        round,
                        base_version,
                        tokens,
                        loss,
                        norm,
                        bytes,
                        fate,
                        reason,
                        (detail or "")[:500] or None,
                        weight,
                        counts_in,
                        pending,
                    ),
                )
                k = ledger_counts.key(block, worker_id, fate, reason)
                ledger_counts.bump(db, k)
                if seen is not None and worker_id is not None:
                    db.execute(
                        "UPDATE workers SET last_seen = MAX(last_seen, ?) WHERE id = ?",
                        (seen, worker_id),
                    )
                update_id = int(cur.lastrowid or 0)
            self._counts[k] = self._counts.get(k, 0) + 1
            return update_id

    def prune_refused(self, keep: int) -> int:
        """Keep only the newest `keep` refused rows; how many were deleted."""
        with self._tx() as db:
            return ledger_counts.prune_refused(db, keep)

    def updates(
        self, *, block: int | None = None, round: int | None = None, fate: str | None = None
    ) -> list[UpdateRow]:
        where, args = [], []
        for col, val in (("block", block), ("round", round), ("fate", fate)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        sql = (
            "SELECT id, received, worker_id, block, round, base_version, tokens, fate, reason,"
            " weight, counts_in, pending, committed_version FROM updates"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [UpdateRow(**dict(r)) for r in self._query(sql + " ORDER BY id", args)]

    def open_accepted(self, block: int) -> list[UpdateRow]:
        """Accepted updates not yet committed (the open round's)."""
        return [
            u for u in self.updates(block=block, fate="accepted") if u.committed_version is None
        ]

    def update_counts(self) -> list[dict[str, Any]]:
        """(block, fate, reason) -> count of every update ever recorded (pruned rows included),
        for metrics and status; from memory, not a scan."""
        with self._lock:
            return ledger_counts.by_block(self._counts)

    def round_losses(self) -> dict[tuple[int, int], float]:
        """(block, round) -> the mean training loss the round's accepted updates reported."""
        return {
            (int(r["block"]), int(r["counts_in"])): float(r["loss"])
            for r in self._query(
                "SELECT block, counts_in, AVG(loss) AS loss FROM updates WHERE fate = 'accepted' "
                "AND loss IS NOT NULL GROUP BY block, counts_in"
            )
        }

    def update_arrivals(self) -> list[tuple[float, int]]:
        """(received, body bytes) of every update in the ledger, accepted or refused."""
        return [
            (float(r["received"]), int(r["bytes"]))
            for r in self._query("SELECT received, bytes FROM updates ORDER BY received")
        ]

    def worker_counts(self) -> dict[int, dict[str, int]]:
        with self._lock:
            return ledger_counts.by_worker(self._counts)

    # ------------------------------------------------------------------ traffic

    def add_traffic(self, rows: Iterable[tuple[str, int, int, int, int, int]]) -> None:
        """(endpoint, block, worker_id, requests, bytes_in, bytes_out) increments."""
        rows = list(rows)
        if not rows:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO traffic VALUES (?,?,?,?,?,?) ON CONFLICT (endpoint, block, "
                "worker_id) DO UPDATE SET requests = requests + excluded.requests, "
                "bytes_in = bytes_in + excluded.bytes_in, "
                "bytes_out = bytes_out + excluded.bytes_out",
                rows,
            )

    def traffic(self) -> list[dict[str, Any]]:
        return [
            dict(r)
            for r in self._query("SELECT * FROM traffic ORDER BY endpoint, block, worker_id")
        ]
