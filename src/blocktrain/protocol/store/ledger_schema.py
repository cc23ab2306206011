"""The ledger's SQLite schema and the typed rows it hands out."""

from __future__ import annotations

import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 5

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    hash TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    revoked REAL
);
CREATE TABLE IF NOT EXISTS workers (
    id INTEGER PRIMARY KEY,
    token_id INTEGER NOT NULL REFERENCES tokens(id),
    name TEXT,
    block INTEGER NOT NULL,
    registered REAL NOT NULL,
    last_seen REAL NOT NULL,
    pulled_round INTEGER,
    left_at REAL
);
CREATE TABLE IF NOT EXISTS blocks (
    block INTEGER PRIMARY KEY,
    version INTEGER NOT NULL,
    round INTEGER NOT NULL,
    started_at REAL
);
CREATE TABLE IF NOT EXISTS rounds (
    block INTEGER NOT NULL,
    round INTEGER NOT NULL,
    base_version INTEGER NOT NULL,
    new_version INTEGER NOT NULL,
    started_at REAL,
    deadline REAL,
    closed_at REAL NOT NULL,
    cause TEXT NOT NULL,
    accepted INTEGER NOT NULL,
    refused INTEGER NOT NULL,
    expected INTEGER NOT NULL,
    reported INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    held TEXT,
    PRIMARY KEY (block, round)
);
CREATE TABLE IF NOT EXISTS updates (
    id INTEGER PRIMARY KEY,
    received REAL NOT NULL,
    token_id INTEGER,
    worker_id INTEGER,
    block INTEGER,
    round INTEGER,
    base_version INTEGER,
    tokens INTEGER,
    loss REAL,
    norm REAL,
    bytes INTEGER NOT NULL,
    fate TEXT NOT NULL CHECK (fate IN ('accepted', 'refused')),
    reason TEXT,
    detail TEXT,
    weight REAL,
    counts_in INTEGER,
    pending TEXT,
    committed_version INTEGER,
    committed_at REAL
);
CREATE INDEX IF NOT EXISTS updates_round ON updates (block, round);
CREATE INDEX IF NOT EXISTS updates_open ON updates (block, fate, committed_version);
CREATE INDEX IF NOT EXISTS updates_fate ON updates (fate, id);
CREATE TABLE IF NOT EXISTS update_counts (
    block INTEGER NOT NULL,
    worker_id INTEGER NOT NULL,
    fate TEXT NOT NULL,
    reason TEXT NOT NULL,
    n INTEGER NOT NULL,
    PRIMARY KEY (block, worker_id, fate, reason)
);
CREATE TABLE IF NOT EXISTS token_blocks (
    token_id INTEGER NOT NULL REFERENCES tokens(id),
    block INTEGER NOT NULL,
    PRIMARY KEY (token_id, block)
);
CREATE TABLE IF NOT EXISTS rollbacks (
    block INTEGER NOT NULL,
    round INTEGER NOT NULL,
    from_version INTEGER NOT NULL,
    to_version INTEGER NOT NULL,
    new_version INTEGER NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (block, round)
);
CREATE TABLE IF NOT EXISTS traffic (
    endpoint TEXT NOT NULL,
    block INTEGER NOT NULL,
    worker_id INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL,
    PRIMARY KEY (endpoint, block, worker_id)
);
CREATE TABLE IF NOT EXISTS reputation (
    kind TEXT NOT NULL CHECK (kind IN ('token', 'worker')),
    id INTEGER NOT NULL,
    score REAL NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (kind, id)
);
"""
# Schema version 4 added the reputation table: `CREATE TABLE IF NOT EXISTS` gives it to an
# older ledger on open (an identity without a row has reputation 1, as every identity had
# before), and `migrate` records the version.

COLUMNS_ADDED = (
    # (table, column, type), in the order they were added; a ledger written before gets them
    # on open (schema version 2: bans; 3: why a round's rule refused to aggregate; 5: viewer
    # tokens, which may only watch: every token written before may do everything, as before)
    ("tokens", "banned", "REAL"),
    ("tokens", "ban_reason", "TEXT"),
    ("rounds", "held", "TEXT"),
    ("tokens", "viewer", "INTEGER NOT NULL DEFAULT 0"),
)


def migrate(db: sqlite3.Connection) -> None:
    """Bring a ledger of an earlier schema to this one, after SCHEMA created what it lacked:
    the columns added since, and the version. Call it in a transaction."""
    for table, column, kind in COLUMNS_ADDED:
        have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))


TOKEN_SELECT = (
    "SELECT t.id, t.name, t.created, t.revoked, t.banned, t.ban_reason, t.viewer, "
    "(SELECT group_concat(b.block) FROM token_blocks b WHERE b.token_id = t.id) AS blocks "
    "FROM tokens t"
)

NONE_KEY = -1
"""Stands for "no block" / "no worker" in the keys of the traffic and update_counts tables."""


@dataclass(frozen=True)
class TokenRow:
    id: int
    name: str
    created: float
    revoked: float | None
    banned: float | None = None
    ban_reason: str | None = None
    blocks: tuple[int, ...] = ()
    """The blocks the token is pinned to (empty: any block)."""
    viewer: bool = False
    """It may only watch the run (`service.identity.VIEWER_ENDPOINTS`), never train."""

    @classmethod
    def of(cls, row: Any) -> TokenRow:
        """A row of TOKEN_SELECT."""
        data = dict(row)
        text = data.pop("blocks")
        blocks = tuple(sorted(int(b) for b in text.split(","))) if text else ()
        return cls(**{**data, "viewer": bool(data["viewer"])}, blocks=blocks)


@dataclass(frozen=True)
class WorkerRow:
    id: int
    token_id: int
    name: str | None
    block: int
    registered: float
    last_seen: float
    pulled_round: int | None
    left_at: float | None


@dataclass(frozen=True)
class UpdateRow:
    id: int
    received: float
    worker_id: int | None
    block: int | None
    round: int | None
    base_version: int | None
    tokens: int | None
    fate: str
    reason: str | None
    weight: float | None
    counts_in: int | None
    pending: str | None
    committed_version: int | None


def connect(path: Path, *, writer: bool) -> sqlite3.Connection:
    """A connection to the ledger file, shareable between threads (behind a lock): the writer
    (WAL, fsynced by `fsync_wal` after each transaction; foreign keys) or a reader (query_only)."""
    db = sqlite3.connect(str(path), check_same_thread=False, timeout=30.0, isolation_level=None)
    db.row_factory = sqlite3.Row
    # NORMAL, not FULL: a commit does not fsync the WAL itself; the writer does, through
    # `fsync_wal`, after each transaction, or (an accepted update's row) the service does
    # once it has released its lock, so that concurrent pushes share an fsync.
    pragmas = (
        ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON")
        if writer
        else ("query_only=ON",)
    )
    for pragma in pragmas:
        db.execute(f"PRAGMA {pragma}")
    return db


def fsync_wal(path: Path) -> None:
    """Make every transaction committed so far durable: fsync the WAL (what synchronous=FULL
    does at each commit), or the database when no WAL is left."""
    wal = path.with_name(path.name + "-wal")
    fd = os.open(wal if wal.exists() else path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Readers:
    """Query-only connections to the ledger, one per thread: every request reads its token and
    worker here, and such reads then wait neither for each other nor for the writer's fsync (in
    WAL mode a reader sees the last commit at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def query(self, sql: str, args: tuple[object, ...]) -> list[sqlite3.Row]:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = connect(self.path, writer=False)
            with self._lock:
                self._all.append(db)
        return list(db.execute(sql, args))

    def close(self) -> None:
        with self._lock:
            for db in self._all:
                db.close()
            self._all.clear()
