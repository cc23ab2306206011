"""The ledger's part for identity and recovery: tokens, bans, reputations, revoked tokens' dropped
updates, when each worker last reported, and rollbacks. A mixin of `ledger.Ledger`, which provides the connection;
kept apart so that each file holds one concern."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

from blocktrain.protocol.store import ledger_counts
from blocktrain.protocol.store.ledger_counts import CountKey
from blocktrain.protocol.store.ledger_schema import TOKEN_SELECT, TokenRow


class RecoveryTables:
    """Methods over the connection `Ledger` opens; every method is one transaction."""

    _counts: dict[CountKey, int]
    """The ledger's in-memory mirror of its update counters (`ledger_counts`)."""

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        raise NotImplementedError

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        raise NotImplementedError

    # ------------------------------------------------------------------ tokens

    def add_token(
        self,
        name: str,
        token_hash: str,
        now: float,
        blocks: Iterable[int] = (),
        *,
        viewer: bool = False,
    ) -> int:
        """A new token; `blocks`: the only blocks it may register on (none: any); `viewer`: it
        may only watch (the status, the history, metrics), never train."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO tokens (name, hash, created, viewer) VALUES (?, ?, ?, ?)",
                (name, token_hash, now, int(viewer)),
            )
            token_id = int(cur.lastrowid or 0)
            db.executemany(
                "INSERT OR IGNORE INTO token_blocks VALUES (?, ?)",
                [(token_id, int(b)) for b in blocks],
            )
            return token_id

    def token_by_hash(self, token_hash: str) -> TokenRow | None:
        rows = self._read(TOKEN_SELECT + " WHERE t.hash = ?", (token_hash,))
        return TokenRow.of(rows[0]) if rows else None

    def token_by_name(self, name: str) -> TokenRow | None:
        rows = self._query(TOKEN_SELECT + " WHERE t.name = ?", (name,))
        return TokenRow.of(rows[0]) if rows else None

    def tokens(self) -> list[TokenRow]:
        return [TokenRow.of(r) for r in self._query(TOKEN_SELECT + " ORDER BY t.id")]

    def revoke_token(self, name: str, now: float) -> bool:
        with self._tx() as db:
            cur = db.execute(
                "UPDATE tokens SET revoked = ? WHERE name = ? AND revoked IS NULL", (now, name)
            )
            return cur.rowcount > 0

    def ban_token(self, name: str, now: float, reason: str | None = None) -> bool:
        """Revoke (if not yet) and ban a token; False if it was banned already."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE tokens SET revoked = COALESCE(revoked, ?), banned = ?, ban_reason = ? "
                "WHERE name = ? AND banned IS NULL",
                (now, now, reason, name),
            )
            return cur.rowcount > 0

    def shut_out_tokens(self) -> dict[int, str]:
        """Revoked or banned tokens: id -> the reason code their pending updates are dropped
        with (a small table: cheap enough for every tick)."""
        rows = self._query(
            "SELECT id, banned FROM tokens WHERE revoked IS NOT NULL OR banned IS NOT NULL"
        )
        return {
            int(r["id"]): "banned_token" if r["banned"] is not None else "revoked_token"
            for r in rows
        }

    def save_reputation(self, identity: tuple[str, int], score: float, now: float) -> None:
        """An identity's reputation (`effect.Reputation`; `Registry.identity` names it) after
        an update changed it, so that a penalty outlives a restart."""
        kind, ident = identity
        with self._tx() as db:
            db.execute(
                "INSERT INTO reputation VALUES (?, ?, ?, ?) ON CONFLICT (kind, id) "
                "DO UPDATE SET score = excluded.score, updated = excluded.updated",
                (kind, ident, score, now),
            )

    def reputations(self) -> dict[tuple[str, int], float]:
        """Every identity whose reputation an update changed: (kind, id) -> its score."""
        rows = self._query("SELECT kind, id, score FROM reputation")
        return {(str(r["kind"]), int(r["id"])): float(r["score"]) for r in rows}

    # ------------------------------------------------------------------ updates and rounds

    def owners(self, update_ids: Iterable[int]) -> dict[int, int | None]:
        """Update id -> the token that sent it, by primary key (cheap for a round's updates)."""
        ids = list(update_ids)
        out: dict[int, int | None] = {}
        for start in range(0, len(ids), 500):  # SQLite's bound on variables per statement
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for r in self._query(f"SELECT id, token_id FROM updates WHERE id IN ({marks})", chunk):
                out[int(r["id"])] = None if r["token_id"] is None else int(r["token_id"])
        return out

    def drop_updates(self, update_ids: Iterable[int], reason: str, detail: str) -> None:
        """Accepted, uncommitted updates taken out of their round: they become refusals with
        `reason`, so that every accepted update still goes into exactly one version."""
        ids = list(update_ids)
        with self._tx() as db:
            moves = ledger_counts.refuse(db, ids, reason)
            db.executemany(
                "UPDATE updates SET fate = 'refused', reason = ?, detail = ?, pending = NULL "
                "WHERE id = ? AND fate = 'accepted' AND committed_version IS NULL",
                [(reason, detail[:500], uid) for uid in ids],
            )
        self._mirror(moves)

    def _mirror(self, moves: list[tuple[CountKey, CountKey]]) -> None:
        for old, new in moves:
            self._counts[old] = self._counts.get(old, 0) - 1
            self._counts[new] = self._counts.get(new, 0) + 1

    def last_reports(self, block: int) -> dict[int, float]:
        """Worker -> when its last update for `block` arrived (accepted or refused)."""
        rows = self._query(
            "SELECT worker_id, MAX(received) AS at FROM updates WHERE block = ? AND "
            "worker_id IS NOT NULL GROUP BY worker_id",
            (block,),
        )
        return {int(r["worker_id"]): float(r["at"]) for r in rows}

    def rollback(self, *, block: int, to_version: int, now: float) -> tuple[int, int, list[str]]:
        """Close the open round of `block` as a rollback to `to_version`, published as the next
        version number (the caller has written its weights there), and drop the round's accepted
        updates, all in one transaction. Returns (closed round, new version, dropped bodies)."""
        with self._tx() as db:
            row = db.execute(
                "SELECT version, round FROM blocks WHERE block = ?", (block,)
            ).fetchone()
            if row is None:
                raise KeyError(block)
            version, round_ = int(row["version"]), int(row["round"])
            new_version = version + 1
            dropped = db.execute(
                "SELECT id, pending FROM updates WHERE block = ? AND fate = 'accepted' "
                "AND committed_version IS NULL",
                (block,),
            ).fetchall()
            db.execute(
                "INSERT INTO rounds (block, round, base_version, new_version, started_at, "
                "deadline, closed_at, cause, accepted, refused, expected, reported, tokens) "
                "VALUES (?,?,?,?,NULL,NULL,?,'rollback',0,?,0,0,0)",
                (block, round_, version, new_version, now, len(dropped)),
            )
            db.execute(
                "INSERT INTO rollbacks (block, round, from_version, to_version, new_version, at) "
                "VALUES (?,?,?,?,?,?)",
                (block, round_, version, to_version, new_version, now),
            )
            db.execute(
                "UPDATE blocks SET version = ?, round = ?, started_at = NULL WHERE block = ?",
                (new_version, round_ + 1, block),
            )
            moves = ledger_counts.refuse(db, [int(r["id"]) for r in dropped], "rolled_back")
            db.executemany(
                "UPDATE updates SET fate = 'refused', reason = 'rolled_back', detail = ?, "
                "pending = NULL WHERE id = ?",
                [
                    (f"block {block} was rolled back to version {to_version}", r["id"])
                    for r in dropped
                ],
            )
        self._mirror(moves)
        return round_, new_version, [r["pending"] for r in dropped if r["pending"]]

    def rollbacks(self, block: int | None = None) -> list[dict[str, Any]]:
        sql = "SELECT * FROM rollbacks" + (" WHERE block = ?" if block is not None else "")
        return [
            dict(r) for r in self._query(sql + " ORDER BY at", () if block is None else (block,))
        ]
