"""The ledger's update counters: how many updates each (block, worker, fate, reason) has had,
kept in the `update_counts` table in the same transaction as each update's row, and mirrored in
memory, so that `/v1/status` and `/metrics` cost O(workers x reasons), never O(ledger rows),
and stay right after refused rows are pruned."""

from __future__ import annotations

import sqlite3
from typing import Any

from blocktrain.protocol.store.ledger_schema import NONE_KEY

CountKey = tuple[int, int, str, str]
"""(block, worker_id, fate, reason), NONE_KEY for no block / no worker, '' for no reason."""


def key(block: int | None, worker_id: int | None, fate: str, reason: str | None) -> CountKey:
    return (
        NONE_KEY if block is None else block,
        NONE_KEY if worker_id is None else worker_id,
        fate,
        reason or "",
    )


def bump(db: sqlite3.Connection, k: CountKey) -> None:
    db.execute(
        "INSERT INTO update_counts VALUES (?,?,?,?,1) ON CONFLICT (block, worker_id, fate, "
        "reason) DO UPDATE SET n = n + 1",
        k,
    )


def refuse(db: sqlite3.Connection, ids: list[int], reason: str) -> list[tuple[CountKey, CountKey]]:
    """Move the counts of accepted, uncommitted updates `ids` to (refused, `reason`), as their
    rows are about to be (a revoked token's dropped updates, a rolled-back round); the moves,
    for the in-memory mirror. Call it in the transaction that changes the rows."""
    moves = []
    for start in range(0, len(ids), 500):  # SQLite's bound on variables per statement
        chunk = ids[start : start + 500]
        rows = db.execute(
            f"SELECT block, worker_id, reason FROM updates WHERE id IN ({','.join('?' * len(chunk))})"
            " AND fate = 'accepted' AND committed_version IS NULL",
            chunk,
        ).fetchall()
        for block, worker, old_reason in rows:
            old = key(block, worker, "accepted", old_reason)
            new = key(block, worker, "refused", reason)
            db.execute(
                "UPDATE update_counts SET n = n - 1 WHERE block = ? AND worker_id = ? "
                "AND fate = ? AND reason = ?",
                old,
            )
            bump(db, new)
            moves.append((old, new))
    return moves


def load(db: sqlite3.Connection) -> dict[CountKey, int]:
    """The counters, filled once from the updates table when the ledger predates them."""
    (have,) = db.execute("SELECT COUNT(*) FROM update_counts").fetchone()
    if not have:
        db.execute(
            "INSERT INTO update_counts SELECT COALESCE(block, ?), COALESCE(worker_id, ?), fate, "
            "COALESCE(reason, ''), COUNT(*) FROM updates GROUP BY 1, 2, 3, 4",
            (NONE_KEY, NONE_KEY),
        )
    return {
        (int(r[0]), int(r[1]), str(r[2]), str(r[3])): int(r[4])
        for r in db.execute("SELECT block, worker_id, fate, reason, n FROM update_counts")
    }


def by_block(counts: dict[CountKey, int]) -> list[dict[str, Any]]:
    """(block, fate, reason) -> count rows, sorted, as `Ledger.update_counts` returns them."""
    out: dict[tuple[int, str, str], int] = {}
    for (block, _, fate, reason), n in counts.items():
        out[(block, fate, reason)] = out.get((block, fate, reason), 0) + n
    return [
        {"block": None if b == NONE_KEY else b, "fate": f, "reason": r, "n": n}
        for (b, f, r), n in sorted(out.items())
        if n  # a count moved away by `refuse` leaves a zero behind
    ]


def by_worker(counts: dict[CountKey, int]) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for (_, worker, fate, _), n in counts.items():
        if worker != NONE_KEY:
            entry = out.setdefault(worker, {})
            entry[fate] = entry.get(fate, 0) + n
    return out


def prune_refused(db: sqlite3.Connection, keep: int) -> int:
    """Delete all but the newest `keep` refused rows (the counters keep their totals); the
    number deleted. Accepted rows are what accounting and restarts need: they stay."""
    row = db.execute(
        "SELECT id FROM updates WHERE fate = 'refused' ORDER BY id DESC LIMIT 1 OFFSET ?",
        (keep,),
    ).fetchone()
    if row is None:
        return 0
    return db.execute(
        "DELETE FROM updates WHERE fate = 'refused' AND id <= ?", (int(row[0]),)
    ).rowcount
