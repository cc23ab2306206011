"""Viewer tokens (`blocktrain token add --viewer`): they may read what the dashboard and
`blocktrain status` read, and nothing that trains (issue 30: `cluster` stored its tokens only
as hashes, so nobody could look at its dashboard; it now prints a viewer token)."""

from __future__ import annotations

import sqlite3

from blocktrain.protocol.store.ledger import Ledger
from blocktrain.protocol.store.ledger_schema import SCHEMA_VERSION
from blocktrain.protocol.store.tokens import hash_token, new_token
from tests.protocol.conftest import T0, auth, delta_body


def viewer(h) -> str:
    token = new_token()
    h.state.ledger.add_token("dashboard", hash_token(token), T0, viewer=True)
    return token


def test_a_viewer_token_reads_the_status_and_never_trains(harness):
    h = harness
    watch = viewer(h)
    w = h.register(h.alice, block=0)["worker_id"]
    for path in ("/v1/status", "/v1/history", "/v1/config", "/v1/directory", "/v1/blocks/0/round"):
        r = h.client.get(path, headers=auth(watch))
        assert r.status_code in (200, 404), (path, r.text)  # no directory: 404 without peers
        if r.status_code == 404:
            assert r.json()["reason"] != "viewer_token", path

    def refused(r) -> None:
        assert r.status_code == 403 and r.json()["reason"] == "viewer_token", r.text
        assert "viewer token" in r.json()["detail"]

    refused(h.client.post("/v1/workers", json={"block": 0}, headers=auth(watch)))
    refused(h.pull(watch, w, 0))  # another token's worker: refused as a viewer all the same
    refused(h.client.get("/v1/blocks/0", headers=auth(watch)))
    refused(h.push(watch, w, 0, delta_body(0, worker=w)))
    refused(h.client.delete(f"/v1/workers/{w}", headers=auth(watch)))
    refused(h.client.get("/v1/blocks/0/versions/0", headers=auth(watch)))
    # the worker's own token still does everything
    assert h.pull(h.alice, w, 0).status_code == 200
    assert h.state.ledger.token_by_hash(hash_token(watch)).viewer is True
    assert h.state.ledger.token_by_hash(hash_token(h.alice)).viewer is False


def test_a_ledger_of_schema_4_gains_the_viewer_column(tmp_path):
    """Schema 4 is schema 5 without tokens.viewer: every token written before may train."""
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    ledger.add_token("alice", "h", 1.0)
    ledger.close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE tokens DROP COLUMN viewer")
        db.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    db.close()
    ledger = Ledger(path)
    (alice,) = ledger.tokens()
    assert alice.name == "alice" and alice.viewer is False
    ledger.add_token("watch", "h2", 2.0, viewer=True)
    assert ledger.token_by_name("watch").viewer is True
    ledger.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta").fetchone() == (str(SCHEMA_VERSION),)
    db.close()
