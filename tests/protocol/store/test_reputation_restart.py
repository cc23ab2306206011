"""Reputation outlives a restart: an identity's penalty (and the exclusion it leads to), like a
ban, is in the ledger and restored when the aggregator starts again over its state folder; a
ledger of the previous schema gains the table when opened."""

from __future__ import annotations

import sqlite3

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.http.status import snapshot
from blocktrain.protocol.store.ledger import Ledger
from blocktrain.protocol.store.ledger_schema import SCHEMA_VERSION
from blocktrain.protocol.store.storage import StateDir
from tests.protocol.conftest import (
    SETTINGS,
    FakeClock,
    add_token,
    auth,
    block_tensors,
    delta_body,
    make_state,
)
from tests.protocol.core.test_engine_trust import TargetProbe

BASE = block_tensors(100)  # block 0 of make_state
TARGET = {k: v + 1.0 for k, v in BASE.items()}
GOOD = {k: torch.full_like(v, 0.1) for k, v in BASE.items()}  # toward TARGET: loss falls
BAD = {k: torch.full_like(v, -0.1) for k, v in BASE.items()}  # away from it: harmful


class Aggregator:
    """An app with the effect probe over a state folder; `restart` opens a new one over it."""

    def __init__(self, root, clock: FakeClock) -> None:
        self.root, self.clock = root, clock
        self.state = StateDir(root)
        app = create_app(storage=self.state, clock=clock, probe=TargetProbe(TARGET))
        self.http = TestClient(app, base_url="http://agg")
        self.service = app.state.service

    def restart(self) -> Aggregator:
        self.state.close()
        return Aggregator(self.root, self.clock)

    def next_round(self, tokens: dict[str, str], workers: dict[str, int]) -> None:
        """Past the open round's deadline, then pulls start the next round's clock (a worker
        reports once a round: a second push is a duplicate, and is not probed)."""
        self.clock.advance(SETTINGS.deadline_s + 1)
        self.service.tick()
        for name in ("mallory", "alice"):
            self.http.get("/v1/blocks/0", headers=auth(tokens[name], workers[name]))

    def push(self, token: str, worker: int, tensors: dict) -> tuple[int, str]:
        rounds = self.service.blocks[0].rounds
        body = delta_body(0, tensors=tensors, round=rounds.round, base_version=rounds.version)
        r = self.http.post("/v1/blocks/0/updates", content=body, headers=auth(token, worker))
        return r.status_code, r.json().get("reason", "accepted")


@pytest.fixture
def setup(tmp_path):
    state = make_state(tmp_path / "s", SETTINGS.replace(effect_probe="on"))
    tokens = {name: add_token(state, name) for name in ("alice", "bob", "mallory")}
    ids = {name: state.ledger.token_by_name(name).id for name in tokens}  # type: ignore[union-attr]
    state.close()
    agg = Aggregator(tmp_path / "s", FakeClock())
    workers = {}
    for name, token in tokens.items():
        reg = agg.http.post("/v1/workers", json={"block": 0}, headers=auth(token)).json()
        workers[name] = reg["worker_id"]
        assert (
            agg.http.get("/v1/blocks/0", headers=auth(token, reg["worker_id"])).status_code == 200
        )
    return agg, tokens, ids, workers


def test_a_penalty_and_an_exclusion_survive_a_restart(setup):
    agg, tokens, ids, workers = setup
    mallory = ("token", ids["mallory"])
    assert agg.push(tokens["mallory"], workers["mallory"], BAD) == (422, "harmful")
    assert agg.push(tokens["alice"], workers["alice"], GOOD) == (200, "accepted")
    block = snapshot(agg.service)["blocks"][0]
    assert block["probe_band"] is None, "one accepted update is no band yet"
    rep = agg.service.engine.reputation
    assert rep.of(mallory) == 0.5 and rep.of(("token", ids["alice"])) == 1.0
    assert agg.state.ledger.reputations() == {mallory: 0.5}, "an unchanged 1 writes no row"

    agg = agg.restart()
    assert agg.service.engine.reputation.of(mallory) == 0.5
    for _ in range(3):  # 0.5 -> 0.25 -> 0.125 -> 0.0625, below min_reputation (0.1)
        agg.next_round(tokens, workers)
        assert agg.push(tokens["mallory"], workers["mallory"], BAD) == (422, "harmful")
    assert agg.state.ledger.reputations()[mallory] == pytest.approx(0.0625)

    agg.state.ledger.ban_token("bob", agg.clock.now, "sign flips")
    agg = agg.restart()
    assert agg.service.engine.reputation.of(mallory) == pytest.approx(0.0625)
    agg.next_round(tokens, workers)
    assert agg.push(tokens["mallory"], workers["mallory"], GOOD) == (403, "low_reputation")
    assert agg.push(tokens["bob"], workers["bob"], GOOD) == (403, "banned_token")
    back = pytest.approx(0.1625)  # refused, but probed: the helpful update counts
    assert agg.state.ledger.reputations()[mallory] == back
    shown = {w["worker_id"]: w["reputation"] for w in snapshot(agg.service)["workers"]["list"]}
    assert shown[workers["mallory"]] == back and shown[workers["alice"]] == 1.0
    agg.state.close()


def test_a_helpful_update_after_a_penalty_is_saved_and_restored_with_its_weight(setup):
    """Reputation climbs back (+0.1) in the ledger too; an accepted update still waiting in its
    round after a restart votes with its identity's reputation, as before the restart."""
    agg, tokens, ids, workers = setup
    mallory = ("token", ids["mallory"])
    assert agg.push(tokens["mallory"], workers["mallory"], BAD) == (422, "harmful")
    agg.clock.advance(SETTINGS.deadline_s + 1)  # round 0 closes: mallory may report again
    agg.service.tick()
    for name in ("mallory", "alice"):  # alice's pull keeps the round open after mallory's push
        agg.http.get("/v1/blocks/0", headers=auth(tokens[name], workers[name]))
    assert agg.push(tokens["mallory"], workers["mallory"], GOOD) == (200, "accepted")
    assert agg.state.ledger.reputations() == {mallory: pytest.approx(0.6)}
    (before,) = agg.service.blocks[0].acc.entries.values()
    assert before.weight == pytest.approx(0.6), "weighted with the identity's reputation"

    agg = agg.restart()
    assert agg.service.engine.reputation.of(mallory) == pytest.approx(0.6)
    (after,) = agg.service.blocks[0].acc.entries.values()
    assert after.identity == mallory and after.weight == pytest.approx(0.6)
    agg.state.close()


def test_a_ledger_of_the_previous_schema_gains_the_reputation_table(tmp_path):
    """Schema 3 is schema 4 without the reputation table: made here by dropping it (and it
    comes up to the current schema)."""
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE reputation")
        db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    db.close()
    ledger = Ledger(path)
    assert ledger.reputations() == {}
    ledger.save_reputation(("token", 7), 0.5, 1.0)
    ledger.save_reputation(("token", 7), 0.25, 2.0)
    ledger.save_reputation(("worker", 7), 0.5, 2.0)
    assert ledger.reputations() == {("token", 7): 0.25, ("worker", 7): 0.5}
    ledger.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta").fetchone() == (str(SCHEMA_VERSION),)
    db.close()
