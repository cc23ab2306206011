"""The SQLite ledger: what is recorded, and that it survives a reopen."""

from __future__ import annotations

import sqlite3

import pytest

from blocktrain.protocol.store.ledger import Ledger


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "ledger.sqlite")
    yield led
    led.close()


def test_tokens_add_find_revoke(ledger):
    tid = ledger.add_token("alice", "h" * 64, 1.0)
    assert ledger.token_by_hash("h" * 64).id == tid
    assert ledger.token_by_hash("x" * 64) is None
    with pytest.raises(sqlite3.IntegrityError):
        ledger.add_token("alice", "y" * 64, 2.0)
    assert ledger.revoke_token("alice", 3.0)
    assert not ledger.revoke_token("alice", 4.0), "already revoked"
    assert ledger.token_by_name("alice").revoked == 3.0


def test_workers_get_ids_from_zero(ledger):
    tid = ledger.add_token("alice", "h" * 64, 1.0)
    assert [ledger.add_worker(tid, b, None, 1.0) for b in (0, 1, 0)] == [0, 1, 2]
    assert ledger.latest_worker_of(tid).id == 2
    ledger.worker_left(2, 5.0)
    assert ledger.latest_worker_of(tid).id == 1
    assert [w.id for w in ledger.workers()] == [0, 1]
    assert len(ledger.workers(active_only=False)) == 3


def test_commit_round_marks_updates_and_moves_the_block(ledger, tmp_path):
    ledger.init_blocks(2)
    tid = ledger.add_token("alice", "h" * 64, 1.0)
    w = ledger.add_worker(tid, 1, None, 1.0)
    uid = ledger.record_update(
        received=2.0,
        bytes=100,
        fate="accepted",
        token_id=tid,
        worker_id=w,
        block=1,
        round=0,
        base_version=0,
        tokens=64,
        pending="pending/1/x.safetensors",
    )
    ledger.record_update(
        received=2.5,
        bytes=7,
        fate="refused",
        token_id=None,
        worker_id=None,
        block=1,
        reason="invalid_token",
    )
    assert [u.id for u in ledger.open_accepted(1)] == [uid]
    ledger.commit_round(
        block=1,
        round=0,
        base_version=0,
        new_version=1,
        started_at=1.5,
        deadline=31.5,
        closed_at=3.0,
        cause="all_reported",
        refused=0,
        expected=1,
        reported=1,
        update_ids=[uid],
    )
    assert ledger.open_accepted(1) == []
    assert ledger.block_state(1) == (1, 1, None)
    assert ledger.block_state(0) == (0, 0, None)
    (row,) = ledger.rounds(1)
    assert row["tokens"] == 64 and row["cause"] == "all_reported" and row["accepted"] == 1
    ledger.close()
    again = Ledger(tmp_path / "ledger.sqlite")
    (u,) = again.updates(fate="accepted")
    assert u.committed_version == 1 and u.pending is None
    counts = {(r["fate"], r["reason"]): r["n"] for r in again.update_counts()}
    assert counts == {("accepted", ""): 1, ("refused", "invalid_token"): 1}
    again.close()


def test_traffic_accumulates(ledger):
    ledger.add_traffic([("pull", 0, 1, 1, 0, 1000), ("push", 0, 1, 1, 900, 50)])
    ledger.add_traffic([("pull", 0, 1, 2, 0, 2000)])
    rows = {r["endpoint"]: r for r in ledger.traffic()}
    assert rows["pull"]["requests"] == 3 and rows["pull"]["bytes_out"] == 3000
    assert rows["push"]["bytes_in"] == 900
