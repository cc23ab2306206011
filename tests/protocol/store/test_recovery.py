"""Recovery: rollback to a kept version as a new version, temporary files left by a
kill, ledgers of the earlier schema, and rounds that a silent worker cannot stall."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.protocol.store.ledger import Ledger
from blocktrain.protocol.store.ledger_schema import SCHEMA_VERSION
from blocktrain.protocol.store.recovery import rollback
from blocktrain.protocol.store.storage import StateDir
from tests.protocol.conftest import (
    SETTINGS,
    Harness,
    add_token,
    delta_body,
    make_harness,
    make_state,
)


def commit_rounds(h: Harness, n: int) -> int:
    """`n` rounds of block 0, each with one update from alice's worker; returns the worker."""
    w = h.register(h.alice, block=0)["worker_id"]
    for _ in range(n):
        pulled = h.pull(h.alice, w, 0)
        version, round_ = int(pulled.headers["X-Version"]), int(pulled.headers["X-Round"])
        body = delta_body(0, base_version=version, round=round_, scale=0.5)
        assert h.push(h.alice, w, 0, body).status_code == 200
    return w


def test_rollback_publishes_a_kept_version_as_a_new_one(harness: Harness):
    """Findings "no rollback" and "only 3 versions are kept": with the default keep_versions,
    five rounds later version 1 is still on disk, and rolling back to it publishes its weights
    as version 6 (versions never go back), recorded in the ledger."""
    h = harness
    w = commit_rounds(h, 5)
    assert h.service.blocks[0].rounds.version == 5
    v1 = h.state.load_tensors(0, 1)
    h.service.tick()
    h.state.close()
    state = StateDir(h.state.root)
    done = rollback(state, block=0, to_version=1, now=h.clock.now)
    assert done == {
        "block": 0,
        "round": 5,
        "from_version": 5,
        "to_version": 1,
        "new_version": 6,
        "dropped_updates": 0,
    }
    (row,) = state.ledger.rollbacks(0)
    assert (row["from_version"], row["to_version"], row["new_version"]) == (5, 1, 6)
    assert state.ledger.rounds(0)[-1]["cause"] == "rollback"
    state.close()
    h2 = h.reopen()
    st = h2.service.blocks[0].rounds
    assert (st.version, st.round) == (6, 6)
    for name, value in v1.items():  # the same file's tensors, copied: exact
        assert torch.equal(h2.service.blocks[0].weights[name], value), name
    pulled = h2.pull(h2.alice, w, 0)
    assert pulled.headers["X-Version"] == "6" and pulled.headers["X-Round"] == "6"
    body = delta_body(0, base_version=6, round=6, scale=0.5)
    assert h2.push(h2.alice, w, 0, body).status_code == 200
    assert h2.service.blocks[0].rounds.version == 7, "training goes on from the rollback"
    h2.state.close()


def test_rollback_drops_the_open_rounds_updates(tmp_path):
    h = make_harness(tmp_path / "s")
    a = commit_rounds(h, 2)
    b = h.register(h.bob, block=0)["worker_id"]
    h.pull(h.alice, a, 0)
    h.pull(h.bob, b, 0)
    assert h.push(h.alice, a, 0, delta_body(0, base_version=2, round=2)).status_code == 200
    assert len(h.state.pending_names()) == 1
    h.service.tick()
    h.state.close()
    state = StateDir(h.state.root)
    assert rollback(state, block=0, to_version=0, now=h.clock.now)["dropped_updates"] == 1
    assert state.pending_names() == []
    (dropped,) = [u for u in state.ledger.updates(round=2) if u.worker_id == a]
    assert dropped.fate == "refused" and dropped.reason == "rolled_back"
    state.close()
    h2 = h.reopen()
    assert h2.service.blocks[0].rounds.accepted == [] and h2.service.blocks[0].acc.count == 0
    h2.state.close()


def test_rollback_refuses_clearly(tmp_path):
    state = make_state(tmp_path / "s", replace(SETTINGS, keep_versions=1))
    with pytest.raises(ConfigError, match="not an earlier version"):
        rollback(state, block=0, to_version=0, now=1.0)
    with pytest.raises(ConfigError, match=r"outside 0\.\.1"):
        rollback(state, block=5, to_version=0, now=1.0)
    state.write_endpoint("http://127.0.0.1:1", os.getpid())  # a live aggregator holds it
    with pytest.raises(ProtocolError, match=f"pid {os.getpid()}.*stop it"):
        rollback(state, block=0, to_version=0, now=1.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state.write_endpoint("http://127.0.0.1:1", dead.pid)  # left by a killed aggregator
    with pytest.raises(ConfigError, match="not an earlier version"):
        rollback(state, block=0, to_version=0, now=1.0)
    state.close()


def test_rollback_to_a_pruned_version_names_the_kept_ones(tmp_path):
    h = make_harness(tmp_path / "s", replace(SETTINGS, keep_versions=2))
    commit_rounds(h, 4)
    h.service.tick()
    h.state.close()
    state = StateDir(h.state.root)
    with pytest.raises(ConfigError, match=r"not kept on disk \(kept: 0, 3, 4\)"):
        rollback(state, block=0, to_version=2, now=h.clock.now)
    state.close()


def test_temporary_files_left_by_a_kill_are_removed_at_start(harness: Harness):
    """Finding "`.tmp` files left by a kill are never removed"."""
    h = harness
    root = h.state.root
    left = [
        root / "blocks" / "0" / ".v000001.safetensors.k2j3.tmp",
        root / "pending" / "1" / ".ab12.safetensors.zz.tmp",
        root / ".aggregator.json.q.tmp",
    ]
    for path in left:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"torn")
    keep = root / "blocks" / "0" / "notes.tmp"  # not a name atomic writes use
    keep.write_bytes(b"mine")
    h2 = h.reopen()
    assert not any(p.exists() for p in left)
    assert keep.exists() and h2.state.versions(0) == [0]
    h2.state.close()


def test_a_ledger_of_the_first_schema_gains_the_new_columns(tmp_path):
    path = tmp_path / "ledger.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema_version', '1');"
        "CREATE TABLE tokens (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,"
        " hash TEXT NOT NULL UNIQUE, created REAL NOT NULL, revoked REAL);"
        "INSERT INTO tokens VALUES (1, 'alice', 'h', 5.0, NULL);"
        "CREATE TABLE rounds (block INTEGER NOT NULL, round INTEGER NOT NULL,"
        " base_version INTEGER NOT NULL, new_version INTEGER NOT NULL, started_at REAL,"
        " deadline REAL, closed_at REAL NOT NULL, cause TEXT NOT NULL,"
        " accepted INTEGER NOT NULL, refused INTEGER NOT NULL, expected INTEGER NOT NULL,"
        " reported INTEGER NOT NULL, tokens INTEGER NOT NULL, PRIMARY KEY (block, round));"
        "INSERT INTO rounds VALUES (0, 0, 0, 1, 1.0, 2.0, 2.0, 'deadline', 1, 0, 1, 1, 9);"
    )
    db.commit()
    db.close()
    ledger = Ledger(path)
    (alice,) = ledger.tokens()
    assert (alice.name, alice.banned, alice.blocks) == ("alice", None, ())
    assert ledger.ban_token("alice", 6.0, "spam") and not ledger.ban_token("alice", 7.0)
    row = ledger.token_by_name("alice")
    assert row is not None and (row.revoked, row.banned, row.ban_reason) == (6.0, 6.0, "spam")
    assert ledger.shut_out_tokens() == {1: "banned_token"}
    ledger.commit_round(
        block=0, round=1, base_version=1, new_version=2, started_at=3.0, deadline=4.0,
        closed_at=4.0, cause="quorum", refused=0, expected=2, reported=2, update_ids=[],
        held="median needs more votes",
    )  # fmt: skip
    assert [r["held"] for r in ledger.rounds(0)] == [None, "median needs more votes"]
    ledger.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta").fetchone() == (str(SCHEMA_VERSION),)


def test_a_silent_worker_cannot_make_every_round_wait_for_the_deadline(tmp_path):
    """Finding "a worker that pulls and never pushes makes every round wait for its deadline",
    through the service with the default quorum and grace."""
    h = make_harness(tmp_path / "s", replace(SETTINGS, quorum=0.5, grace_s=None))
    carol = add_token(h.state, "carol")
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]
    mallory = h.register(carol, block=0)["worker_id"]
    for r in range(4):
        for tok, w in ((h.alice, a), (h.bob, b), (carol, mallory)):
            assert h.pull(tok, w, 0).status_code == 200
        start = h.clock.now
        h.clock.advance(2.0)
        for tok, w in ((h.alice, a), (h.bob, b)):
            body = delta_body(0, base_version=r, round=r)
            assert h.push(tok, w, 0, body).status_code == 200
        h.clock.advance(SETTINGS.deadline_s / 10)
        h.service.tick()
        (row,) = [x for x in h.state.ledger.rounds(0) if x["round"] == r]
        assert row["cause"] == "quorum" and row["closed_at"] - start < SETTINGS.deadline_s / 3
    h.state.close()


def test_no_late_update_counts_from_a_round_a_rollback_undid(tmp_path):
    """With staleness, an update trained on the weights a rollback undid is refused, not
    counted late in the next round."""
    h = make_harness(tmp_path / "s", replace(SETTINGS, staleness=2))
    a = commit_rounds(h, 2)
    b = h.register(h.bob, block=0)["worker_id"]
    h.pull(h.bob, b, 0)  # round 2, version 2: bob trains on it through the rollback
    h.service.tick()
    h.state.close()
    state = StateDir(h.state.root)
    rollback(state, block=0, to_version=1, now=h.clock.now)
    state.close()
    h2 = h.reopen()
    r = h2.push(h2.bob, b, 0, delta_body(0, base_version=2, round=2))
    assert r.status_code == 409 and r.json()["reason"] == "stale_version", r.text
    pulled = h2.pull(h2.alice, a, 0)
    assert pulled.headers["X-Version"] == "3" and pulled.headers["X-Round"] == "3"
    h2.state.close()
