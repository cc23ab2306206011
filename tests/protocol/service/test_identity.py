"""Identity: one live worker per token, votes and block choice by token, tokens
pinned to blocks, and revoked or banned tokens' pending updates dropped from their rounds."""

from __future__ import annotations

from dataclasses import replace

import torch

from tests.protocol.conftest import SETTINGS, Harness, add_token, delta_body, make_harness


def test_one_token_cannot_register_thirty_workers(harness: Harness):
    """Finding "one token registered 30 workers on the block of its choice": by default a token
    holds one worker; each new registration retires the previous one, so a restarted worker
    rejoins at once and a flood of registrations leaves one voice."""
    h = harness
    ids = [h.register(h.alice, block=0)["worker_id"] for _ in range(30)]
    assert h.service.blocks[0].rounds.assigned == {ids[-1]}
    registry = h.service.engine.registry
    assert registry.workers_of(registry.identity(ids[-1])[1]) == [ids[-1]]
    retired = h.pull(h.alice, ids[0], 0)
    assert retired.status_code == 404 and retired.json()["reason"] == "unknown_worker"
    assert h.pull(h.alice, ids[-1], 0).status_code == 200
    active = [w.id for w in h.state.ledger.workers() if w.token_id == registry.identity(ids[-1])[1]]
    assert active == [ids[-1]], "the retired workers left in the ledger too"


def test_more_workers_per_token_only_when_allowed(tmp_path):
    h = make_harness(tmp_path / "s", replace(SETTINGS, max_workers_per_token=3))
    ids = [h.register(h.alice, block=0)["worker_id"] for _ in range(4)]
    assert sorted(h.service.blocks[0].rounds.assigned) == ids[1:], "the oldest one retired"
    h.state.close()


def test_a_flooding_token_cannot_steer_honest_workers_away(tmp_path):
    """Finding "honest workers were steered away": blocks are chosen by live identities, so 30
    workers of one token on block 0 count as one replica there."""
    h = make_harness(tmp_path / "s", replace(SETTINGS, max_workers_per_token=30))
    for _ in range(30):
        h.register(h.alice, block=0)
    honest = [add_token(h.state, f"honest{i}") for i in range(3)]
    blocks = [h.register(t)["block"] for t in honest]
    assert blocks == [1, 0, 1], "block 0 holds one identity, not 30 replicas"
    h.state.close()


def test_a_pinned_token_registers_only_on_its_blocks(harness: Harness):
    h = harness
    carol = add_token(h.state, "carol", blocks=[1])
    assert h.register(carol)["block"] == 1, "an unpinned request lands on the pinned block"
    r = h.client.post(
        "/v1/workers", json={"block": 0}, headers={"Authorization": f"Bearer {carol}"}
    )
    assert r.status_code == 403 and r.json()["reason"] == "block_not_allowed"
    assert h.register(h.alice)["block"] == 0, "unpinned tokens still go where replicas are few"


def _alice_pending_bob_in_flight(h: Harness) -> tuple[int, int, dict[str, torch.Tensor]]:
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    assert h.pull(h.bob, b, 0).status_code == 200
    before = h.weights(0)
    r = h.push(h.alice, a, 0, delta_body(0, scale=4.0))  # the update to be undone
    assert r.status_code == 200 and r.json()["accepted"], r.text
    return a, b, before


def _only_bobs_update_went_in(h: Harness, b: int, before: dict[str, torch.Tensor]) -> None:
    r = h.push(h.bob, b, 0, delta_body(0, scale=0.01))
    assert r.status_code == 200, r.text
    st = h.service.blocks[0].rounds
    assert st.round == 1 and st.version == 1, "the revoked worker is not waited for"
    want = torch.tensor(0.01, dtype=torch.float16).float()
    for name, t in before.items():
        assert torch.allclose(h.weights(0)[name], t + want, atol=1e-6), name
    (row,) = h.state.ledger.rounds(0)
    assert row["accepted"] == 1
    accepted = h.state.ledger.updates(fate="accepted")
    assert [u.committed_version for u in accepted] == [1], "every accepted update is committed"
    assert h.state.pending_names() == []


def test_revoking_a_token_drops_its_pending_update_from_the_running_round(harness: Harness):
    """Finding "revoking a token leaves its pending update in the round": the CLI writes the
    ledger (here directly, as another process would); the aggregator's next tick drops it."""
    h = harness
    a, b, before = _alice_pending_bob_in_flight(h)
    h.state.ledger.revoke_token("alice", h.clock.now)
    h.service.tick()
    (dropped,) = [u for u in h.state.ledger.updates(fate="refused") if u.worker_id == a]
    assert dropped.reason == "revoked_token" and dropped.pending is None
    assert h.service.blocks[0].rounds.accepted == []
    _only_bobs_update_went_in(h, b, before)
    _counters_match_the_rows(h)


def _counters_match_the_rows(h: Harness) -> None:
    """The status counters (kept incrementally, `ledger_counts`) follow a dropped update from
    accepted to refused: in memory, in their table, and as a recount of the rows says."""
    ledger = h.state.ledger
    recount = {
        (r["block"], r["fate"], r["reason"]): r["n"]
        for r in ledger._query(
            "SELECT block, fate, COALESCE(reason, '') AS reason, COUNT(*) AS n FROM updates "
            "GROUP BY block, fate, reason"
        )
    }
    in_memory = {(r["block"], r["fate"], r["reason"]): r["n"] for r in ledger.update_counts()}
    assert in_memory == recount
    assert recount[(0, "refused", "revoked_token")] == 1
    h.state.close()
    reopened = {
        (r["block"], r["fate"], r["reason"]): r["n"]
        for r in type(ledger)(ledger.path).update_counts()
    }
    assert reopened == recount


def test_a_token_banned_while_the_aggregator_was_down_is_dropped_at_start(harness: Harness):
    h = harness
    a, b, before = _alice_pending_bob_in_flight(h)
    h.service.tick()
    h.state.ledger.ban_token("alice", h.clock.now, "sign flips")
    h2 = h.reopen()
    (dropped,) = [u for u in h2.state.ledger.updates(fate="refused") if u.worker_id == a]
    assert dropped.reason == "banned_token"
    r = h2.pull(h2.alice, a, 0)
    assert r.status_code == 403 and r.json()["reason"] == "banned_token"
    assert "sign flips" in r.json()["detail"]
    _only_bobs_update_went_in(h2, b, before)
    h2.state.close()


def test_a_retired_worker_cannot_vote_in_the_engine():
    """Finding "each Sybil votes", where no HTTP layer checks the worker (the simulator drives
    the engine directly): four workers registered under one token leave one registered, and
    the three retired ones are refused rather than counted as identities of their own."""
    from blocktrain.protocol.core.round_engine import RoundEngine
    from tests.protocol.conftest import block_tensors

    eng = RoundEngine.fresh({0: block_tensors(100)}, replace(SETTINGS, quorum=1.0))
    ids = iter(range(100))
    sybils = [eng.register(0.0, 0, lambda _b: next(ids), token=7).worker for _ in range(4)]
    honest = [eng.register(0.0, 0, lambda _b: next(ids), token=8 + i).worker for i in range(2)]
    for w in sybils + honest:
        eng.pull(w, 0, 0.0)
    verdicts = {}
    for w in sybils + honest:
        checked = eng.check(0, delta_body(0))
        assert checked.meta is not None
        verdicts[w] = eng.judge(w, 0, checked.meta, 1.0)
        eng.record(w, 0, verdicts[w], 1.0, checked=checked, update_id=w)
    assert [verdicts[w].reason for w in sybils[:3]] == ["unknown_worker"] * 3
    assert all(verdicts[w].accepted for w in sybils[3:] + honest)
    closed = eng.blocks[0].rounds
    assert closed.round == 0 and {c.worker_id for c in closed.accepted} == {sybils[3], *honest}
    assert eng.tick(1.0)[0].closed.cause == "all_reported"
