"""Issue 31, "a token holder can freeze training for free": quorum stuffing and the probe
flood, against the in-process app (virtual clock) and the round engine."""

from __future__ import annotations

import dataclasses

import torch

from blocktrain.protocol.core.probe_slots import PROBE_SLOTS
from blocktrain.protocol.core.round_engine import RoundEngine
from tests.protocol.conftest import (
    SETTINGS,
    add_token,
    auth,
    block_tensors,
    delta_body,
    make_harness,
)
from tests.protocol.core.test_engine_trust import TargetProbe

BASE = block_tensors(100)  # block 0 of the harness
TARGET = {k: v + 1.0 for k, v in BASE.items()}
GOOD = {k: torch.full_like(v, 0.1) for k, v in BASE.items()}  # toward TARGET: the loss falls
BAD = {k: torch.full_like(v, -0.1) for k, v in BASE.items()}  # away from it: harmful
NOTHING = {k: torch.zeros_like(v) for k, v in BASE.items()}  # the loss stays: no_gain, free


def body(tensors: dict, rnd: int = 0, version: int = 0) -> bytes:
    return delta_body(0, tensors=tensors, round=rnd, base_version=version)


def test_junk_from_two_tokens_does_not_close_the_round_before_the_honest_updates(tmp_path):
    """Finding "quorum stuffing": two attacker tokens against two honest workers on one block
    met the quorum with junk at once, the round closed after the minimum grace (deadline /
    10) and the honest updates came late (0 of 14 accepted). Under the default quorum and
    minimum round length, junk counts for nothing and the honest updates land."""
    settings = dataclasses.replace(
        SETTINGS, quorum=0.5, grace_s=SETTINGS.deadline_s / 10, min_round_s=None
    )
    h = make_harness(tmp_path / "s", settings)
    tokens = [h.alice, h.bob, add_token(h.state, "eve"), add_token(h.state, "mallory")]
    workers = [h.register(t, block=0)["worker_id"] for t in tokens]
    for t, w in zip(tokens, workers, strict=True):
        assert h.pull(t, w, 0).status_code == 200
    junk = delta_body(0, dtype="fp32")  # the wrong dtype: refused for its form
    for t, w in zip(tokens[2:], workers[2:], strict=True):
        assert h.push(t, w, 0, junk).json()["reason"] == "bad_dtype"
    for _ in range(20):  # a second of ticks, then the rest of the first half of the deadline
        h.clock.advance(0.05)
        h.service.tick()
    h.clock.advance(settings.deadline_s / 2 - 1)
    h.service.tick()
    assert h.service.blocks[0].rounds.round == 0, "junk is no quorum"
    for t, w in zip(tokens[:2], workers[:2], strict=True):
        r = h.push(t, w, 0, delta_body(0, scale=0.01 * (w + 1)))
        assert r.status_code == 200, r.text
    h.service.tick()
    (row,) = h.client.get("/v1/status", headers=auth(h.alice)).json()["participation"]["0"]
    assert row["cause"] == "all_reported" and row["accepted"] == 2, "junk is waited for no more"
    h.state.close()


def test_junk_from_more_tokens_than_honest_ones_does_not_hold_the_round_to_its_deadline(
    tmp_path,
):
    """Found by bench/live_attacks.py (quorum_stuffing): 3 attacker tokens pulling each round
    of a block and pushing junk for it at once, against its 2 honest workers, held every round
    to its deadline (12 s, against 3 s unattacked): the junk pushers were expected replicas
    that never pass. A replica refused in the open round cannot pass it any more (a second
    push is a duplicate), so the round stops waiting for it, and closes on the honest updates
    as it does without the junk; never on junk alone (the test above)."""
    settings = dataclasses.replace(SETTINGS, quorum=0.5, min_round_s=None)  # deadline / 4
    h = make_harness(tmp_path / "s", settings)
    tokens = [h.alice, h.bob, *(add_token(h.state, n) for n in ("eve", "mallory", "trudy"))]
    workers = [h.register(t, block=0)["worker_id"] for t in tokens]
    for t, w in zip(tokens, workers, strict=True):
        assert h.pull(t, w, 0).status_code == 200
    junk = delta_body(0, dtype="fp32")  # the wrong dtype: refused for its form
    for t, w in zip(tokens[2:], workers[2:], strict=True):
        assert h.push(t, w, 0, junk).json()["reason"] == "bad_dtype"
    h.clock.advance(settings.deadline_s / 4)
    h.service.tick()
    rounds = h.service.blocks[0].rounds
    assert rounds.round == 0, "junk alone closes nothing"
    for t, w in zip(tokens[:2], workers[:2], strict=True):
        r = h.push(t, w, 0, delta_body(0, scale=0.01 * (w + 1)))
        assert r.status_code == 200, r.text
    h.service.tick()
    assert rounds.round == 1, "every replica that can still pass has passed"
    (row,) = h.client.get("/v1/status", headers=auth(h.alice)).json()["participation"]["0"]
    assert row["cause"] == "all_reported" and row["accepted"] == 2, row
    assert row["duration_s"] < settings.deadline_s / 2, row
    h.state.close()


def test_a_round_may_not_close_before_its_minimum_length_over_http(tmp_path):
    settings = dataclasses.replace(SETTINGS, min_round_s=None)  # deadline / 4
    h = make_harness(tmp_path / "s", settings)
    a = h.register(h.alice, block=0)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    assert h.push(h.alice, a, 0, delta_body(0)).status_code == 200
    assert h.service.blocks[0].rounds.round == 0, "every replica passed, but in a burst"
    h.clock.advance(settings.deadline_s / 4)
    h.service.tick()
    assert h.service.blocks[0].rounds.round == 1
    h.state.close()


def test_the_probe_runs_after_the_cheap_checks(harness):
    """Finding "probe flood": the effect probe ran before the duplicate and late checks, so a
    token's repeated pushes each cost a probe. A duplicate, a future round and a stale
    version are refused without one."""
    h = harness
    probe = TargetProbe(TARGET)
    h.service.engine.use_probe(probe)
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]
    for t, w in ((h.alice, a), (h.bob, b)):
        assert h.pull(t, w, 0).status_code == 200
    assert h.push(h.alice, a, 0, body(GOOD)).status_code == 200
    assert probe.calls == 2, "the loss before (once per version) and after"
    for again in (body(GOOD), body(BAD), body(GOOD, rnd=3)):  # alice's identity is done
        assert h.push(h.alice, a, 0, again).json()["reason"] == "duplicate"
    assert h.push(h.bob, b, 0, body(GOOD, rnd=3)).json()["reason"] == "future_round"
    assert h.push(h.bob, b, 0, body(GOOD, version=7)).json()["reason"] == "stale_version"
    assert probe.calls == 2, "none of them reached the probe"


def test_a_token_that_re_registers_after_an_accepted_push_casts_no_second_update(harness):
    """Found by bench/live_attacks.py (push_flood): a token that re-registered a worker after
    each push had 102 pushes accepted in 30 s, 10 a round, every one probed (each new worker's
    push was its first report). Its token may run one worker, so its identity holds at most
    one update a round: the new worker's push is refused `duplicate`, before the probe."""
    h = harness
    probe = TargetProbe(TARGET)
    h.service.engine.use_probe(probe)
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]  # the round waits for it
    for t, w in ((h.alice, a), (h.bob, b)):
        assert h.pull(t, w, 0).status_code == 200
    assert h.push(h.alice, a, 0, body(GOOD)).status_code == 200
    calls = probe.calls
    again = h.register(h.alice, block=0)["worker_id"]  # retires a
    assert again != a and h.pull(h.alice, again, 0).status_code == 200
    r = h.push(h.alice, again, 0, body(GOOD))
    assert r.status_code == 409 and r.json()["reason"] == "duplicate", r.text
    assert "already has 1 update(s) in round 0" in r.json()["detail"]
    assert probe.calls == calls, "refused before the probe"


def test_a_token_s_refused_probes_are_bounded_per_round(harness):
    """A `no_gain` refusal was free, and the probe is the aggregator's costliest step: a token
    that re-registers a worker for every push (each new worker may report once) reaches it at
    most probe_budget times a round without an accepted update; then it is refused `busy`
    (429) before probing, until the round closes."""
    h = harness
    probe = TargetProbe(TARGET)
    h.service.engine.use_probe(probe)
    budget = SETTINGS.probe_budget
    assert budget == 2
    a = h.register(h.alice, block=0)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    eve = add_token(h.state, "eve")
    for _ in range(budget):
        w = h.register(eve, block=0)["worker_id"]
        assert h.push(eve, w, 0, body(NOTHING)).json()["reason"] == "no_gain"
    calls = probe.calls
    for _ in range(3):
        w = h.register(eve, block=0)["worker_id"]
        r = h.push(eve, w, 0, body(NOTHING))
        assert r.status_code == 429 and r.json()["reason"] == "busy", r.text
    assert probe.calls == calls, "refused before probing"
    assert h.push(h.alice, a, 0, body(GOOD)).status_code == 200, "other tokens are not"
    rows = h.state.ledger.updates(fate="refused")
    assert sum(1 for u in rows if u.reason == "busy") == 3
    h.clock.advance(SETTINGS.deadline_s)  # the round closes: a new budget
    h.service.tick()
    rounds = h.service.blocks[0].rounds
    assert rounds.round == 1
    w = h.register(eve, block=0)["worker_id"]
    r = h.push(eve, w, 0, body(NOTHING, rnd=1, version=rounds.version))
    assert r.json()["reason"] == "no_gain"


def test_a_token_that_spent_its_probe_budget_is_refused_before_its_body_is_read(harness):
    """Found by bench/live_attacks.py (push_flood): one token pushing valid-shaped deltas as
    fast as the aggregator answered had 1,359 of its 1,660 pushes refused `busy` in 30 s, and
    the aggregator read, parsed and hashed each body (1 MB at the tiny preset) before
    refusing it: 0.7 of a core, and the honest status and pull requests took 6x their
    unloaded time. Once an identity's probe budget for the open round is spent, every push of
    it to the block is refused before the probe until the round closes; now it is refused
    before its body is read, with the same verdict (429 `busy`, not a report)."""
    from tests.asgi import asgi_request

    h = harness
    h.service.engine.use_probe(TargetProbe(TARGET))
    a = h.register(h.alice, block=0)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    eve = add_token(h.state, "eve")
    for _ in range(SETTINGS.probe_budget):
        w = h.register(eve, block=0)["worker_id"]
        assert h.push(eve, w, 0, body(NOTHING)).json()["reason"] == "no_gain"
    w = h.register(eve, block=0)["worker_id"]
    data = body(NOTHING)
    headers = {
        **auth(eve, w),
        "content-type": "application/vnd.safetensors",
        "content-length": str(len(data)),
    }
    chunks = [data[i : i + 1024] for i in range(0, len(data), 1024)]
    answer = asgi_request(h.client.app, "POST", "/v1/blocks/0/updates", headers, chunks)
    assert answer.status == 429 and b'"busy"' in answer.body, answer.body
    assert answer.bytes_pulled == 0, f"{answer.bytes_pulled} bytes of the body were read"
    rounds = h.service.blocks[0].rounds
    assert w not in rounds.reported, "busy is not a report"
    assert h.push(h.alice, a, 0, body(GOOD)).status_code == 200, "other tokens are not"
    h.clock.advance(SETTINGS.deadline_s)  # the round closes: a new budget
    h.service.tick()
    w = h.register(eve, block=0)["worker_id"]
    r = h.push(eve, w, 0, body(NOTHING, rnd=1, version=h.service.blocks[0].rounds.version))
    assert r.json()["reason"] == "no_gain", r.text


def test_the_probe_s_queue_is_bounded():
    """Memory: at most PROBE_SLOTS updates (and their bodies) hold a place at the probe; the
    next is refused `busy` at once instead of waiting; a place given back is free again, and
    an accepted update's does not count against its identity."""
    eng = RoundEngine.fresh({0: BASE}, SETTINGS, probe=TargetProbe(TARGET))
    ids = iter(range(1000))
    workers = [eng.register(0.0, 0, lambda _b: next(ids), 100 + i).worker for i in range(12)]
    slots = []
    for w in workers[:PROBE_SLOTS]:
        verdict, slot = eng.reserve_probe(w, 0)
        assert verdict.accepted and slot is not None
        slots.append(slot)
    verdict, slot = eng.reserve_probe(workers[PROBE_SLOTS], 0)
    assert verdict.reason == "busy" and "queue is full" in verdict.detail and slot is None
    eng.release_probe(slots.pop(), accepted=True)
    verdict, slot = eng.reserve_probe(workers[PROBE_SLOTS], 0)
    assert verdict.accepted and eng.probing == PROBE_SLOTS
    for s in slots:
        eng.release_probe(s, accepted=True)
    for _ in range(5):  # accepted updates give their place back to their identity
        verdict, s = eng.reserve_probe(workers[0], 0)
        assert verdict.accepted
        eng.release_probe(s, accepted=True)


# ------------------------------------------------------------------------------ replays

REPLAYS = dataclasses.replace(SETTINGS, replay_rounds=8)  # the default (conftest turns it off)


def restamped(tensors: dict, block: int, rnd: int, version: int, worker: int | None) -> bytes:
    return delta_body(block, tensors=tensors, round=rnd, base_version=version, worker=worker)


def direction(seed: int, size: float = 0.02) -> dict[str, torch.Tensor]:
    """A delta of its own direction (random, from `seed`): two seeds' are as far apart as
    independent directions (about 1.4), where honest replicas keep 0.2 and more."""
    return {k: size * v for k, v in block_tensors(seed).items()}


def one_ulp(tensors: dict) -> dict[str, torch.Tensor]:
    """The same tensors in fp16 (the wire's), one value moved by one ulp."""
    out = {k: v.half().clone() for k, v in tensors.items()}
    first = out[sorted(out)[0]].view(-1)
    first.view(torch.int16)[0] += 1
    return out


def noisy(tensors: dict, share: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors with Gaussian noise of `share` of their norm added."""
    gen = torch.Generator().manual_seed(seed)
    noise = {k: torch.randn(v.shape, generator=gen) for k, v in tensors.items()}
    size = sum(float(v.float().square().sum()) for v in tensors.values()) ** 0.5
    scale = share * size / sum(float(n.square().sum()) for n in noise.values()) ** 0.5
    return {k: v.float() + scale * noise[k] for k, v in tensors.items()}


def close_round(h) -> None:
    h.clock.advance(SETTINGS.deadline_s)
    h.service.tick()


def test_accepted_tensors_restamped_for_a_later_round_or_another_block_are_refused(tmp_path):
    """Finding "replays": the same tensors with new round and version metadata were accepted
    3 of 3 rounds, and on another block too; issue 58: and so were they with one fp16 value
    moved by one ulp, or with noise of 1e-3 of their norm, or rescaled."""
    h = make_harness(tmp_path / "s", REPLAYS)
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=1)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    stolen = direction(1)
    assert h.push(h.alice, a, 0, restamped(stolen, 0, 0, 0, a)).status_code == 200
    close_round(h)
    assert h.service.blocks[0].rounds.version == 1
    halved = {k: 0.5 * v for k, v in stolen.items()}
    for near in (stolen, one_ulp(stolen), noisy(stolen, 1e-3), halved):
        w = h.register(h.alice, block=0)["worker_id"]  # a refusal is a report: a new worker
        assert h.pull(h.alice, w, 0).status_code == 200
        r = h.push(h.alice, w, 0, restamped(near, 0, 1, 1, w))
        assert r.status_code == 409 and r.json()["reason"] == "replay", r.text
        assert "accepted in round 0 of block 0" in r.json()["detail"]
    assert h.pull(h.bob, b, 1).status_code == 200
    r = h.push(h.bob, b, 1, restamped(one_ulp(stolen), 1, 0, 0, b))
    assert r.json()["reason"] == "copy", "on another block of the same shape too"
    h.state.close()


def test_a_body_sent_again_by_another_token_is_refused(tmp_path):
    """Finding: a captured body was accepted again from a second token in the same round. As
    captured it names its worker; re-stamped, its tensors give it away, exact or nearly
    (issue 58: one ulp moved, it was accepted with weight 1.0); and tensors another identity
    pushed, even refused, are not anyone else's to send."""
    h = make_harness(tmp_path / "s", REPLAYS)
    names = ("carol", "dave", "eve", "mallory")
    tokens = [h.alice, h.bob, *(add_token(h.state, n) for n in names)]
    a, b, c, d, e, m = (h.register(t, block=0)["worker_id"] for t in tokens)
    for t, w in zip(tokens, (a, b, c, d, e, m), strict=True):
        assert h.pull(t, w, 0).status_code == 200
    honest = direction(1)
    captured = restamped(honest, 0, 0, 0, a)
    assert h.push(h.alice, a, 0, captured).status_code == 200
    r = h.push(h.bob, b, 0, captured)
    assert r.json()["reason"] == "replay" and f"names worker {a}" in r.json()["detail"]
    r = h.push(tokens[2], c, 0, restamped(one_ulp(honest), 0, 0, 0, c))
    assert r.status_code == 409 and r.json()["reason"] == "copy", r.text
    assert "another identity accepted in round 0" in r.json()["detail"]
    r = h.push(tokens[3], d, 0, restamped(noisy(honest, 1e-3), 0, 0, 0, d))
    assert r.json()["reason"] == "copy", r.text
    refused_once = direction(2)
    r = h.push(tokens[4], e, 0, restamped(refused_once, 0, 0, 5, e))  # refused, but pushed
    assert r.json()["reason"] == "stale_version"
    r = h.push(tokens[5], m, 0, restamped(refused_once, 0, 0, 0, m))
    assert r.json()["reason"] == "copy" and "another identity pushed" in r.json()["detail"]
    assert [r["accepted"] for r in h.state.ledger.rounds(0)] == [1], "the first body alone"
    h.state.close()


def test_deltas_that_point_apart_as_honest_replicas_do_are_all_accepted(tmp_path):
    """Two identities' deltas in one round, and one identity's in two rounds, whose directions
    lie as far apart as honest replicas' at the least (0.23 at the tiny preset, round 0: they
    share most of their first steps) are no copies."""
    h = make_harness(tmp_path / "s", REPLAYS)
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]
    base = direction(1)
    for w in (a, b):
        assert h.pull(h.alice if w == a else h.bob, w, 0).status_code == 200
    mine, theirs = noisy(base, 0.2, seed=1), noisy(base, 0.2, seed=2)
    assert h.push(h.alice, a, 0, restamped(mine, 0, 0, 0, a)).status_code == 200
    assert h.push(h.bob, b, 0, restamped(theirs, 0, 0, 0, b)).status_code == 200
    assert h.service.blocks[0].rounds.version == 1, "both reported: the round committed"
    assert h.pull(h.alice, a, 0).status_code == 200
    r = h.push(h.alice, a, 0, restamped(noisy(mine, 0.2, seed=3), 0, 1, 1, a))
    assert r.status_code == 200, r.text
    h.state.close()


def test_an_update_is_bound_to_the_round_and_version_its_worker_pulled(tmp_path):
    """Within the staleness bound an old round's body still counts: a worker that pulled
    round 1 may not push one stamped for round 0 (its own replayed, or anyone's)."""
    h = make_harness(tmp_path / "s", dataclasses.replace(REPLAYS, staleness=1))
    a = h.register(h.alice, block=0)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    assert h.push(h.alice, a, 0, restamped(direction(1), 0, 0, 0, a)).status_code == 200
    close_round(h)
    assert h.pull(h.alice, a, 0).status_code == 200  # round 1, version 1
    old = direction(2)
    r = h.push(h.alice, a, 0, restamped(old, 0, 0, 0, a))
    assert r.json()["reason"] == "replay" and "last pulled round 1" in r.json()["detail"]
    assert h.push(h.alice, a, 0, restamped(old, 0, 1, 1, a)).status_code == 200
    h.state.close()


def test_zero_deltas_are_not_replays_and_the_sketches_are_bounded(tmp_path):
    """A delta of zeros is anyone's to make (the simulator's timing-only workers all send
    one); and the sketches kept are those of the last replay_rounds rounds."""
    h = make_harness(tmp_path / "s", dataclasses.replace(REPLAYS, replay_rounds=1))
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]
    for t, w in ((h.alice, a), (h.bob, b)):
        assert h.pull(t, w, 0).status_code == 200
    for t, w in ((h.alice, a), (h.bob, b)):
        assert h.push(t, w, 0, restamped(NOTHING, 0, 0, 0, w)).status_code == 200
    rounds = h.service.blocks[0].rounds
    assert rounds.round == 1 and len(h.service.engine.seen[0]) == 0, "zeros are not kept"
    for rnd in (1, 2, 3):
        assert h.pull(h.alice, a, 0).status_code == 200
        body = restamped(direction(rnd), 0, rnd, rounds.version, a)
        assert h.push(h.alice, a, 0, body).status_code == 200
        if rounds.round == rnd:
            close_round(h)
        assert rounds.round == rnd + 1
        kept = [e.round for e in h.service.engine.seen[0]]
        assert kept == [rnd], "the last replay_rounds (1) rounds only"
    h.state.close()


def test_a_refused_push_is_fsynced_outside_the_service_lock(harness, monkeypatch):
    """Found by bench/live_attacks.py (push_flood): one token pushing valid-shaped deltas as
    fast as the aggregator answered (about 60 a second, nearly all refused: busy, duplicate,
    late) made the honest status and pull requests wait 8x their unloaded latency. Each
    refusal's ledger row was fsynced (4 ms here) while the service's lock was held, the lock
    that every status, pull and push takes. Now a refused row is fsynced after the lock is
    released, and still before the refusal is answered."""
    from blocktrain.protocol.service import pushes
    from blocktrain.protocol.store import ledger

    h = harness
    real = ledger.fsync_wal
    under_lock: list[bool] = []

    def spy(path):
        under_lock.append(h.service.lock._is_owned())
        real(path)

    w = h.register(h.alice, block=0)["worker_id"]
    v = h.register(h.bob, block=0)["worker_id"]
    assert h.pull(h.alice, w, 0).status_code == 200 and h.pull(h.bob, v, 0).status_code == 200
    monkeypatch.setattr(ledger, "fsync_wal", spy)
    monkeypatch.setattr(pushes, "fsync_wal", spy)
    junk = h.push(h.alice, w, 0, delta_body(0, dtype="fp32"))  # refused for its form
    assert junk.json()["reason"] == "bad_dtype", junk.text
    assert under_lock and not any(under_lock), f"fsyncs under the lock: {under_lock}"
    assert h.push(h.bob, v, 0, delta_body(0)).status_code == 200
    under_lock.clear()
    # the round closed on bob's update (alice's, refused, can no longer pass)
    again = h.push(h.bob, v, 0, delta_body(0, scale=0.02))  # refused for its timing
    assert again.json()["reason"] == "late", again.text
    assert under_lock and not any(under_lock), f"fsyncs under the lock: {under_lock}"
    reasons = [u.reason for u in h.state.ledger.updates(fate="refused")]
    assert reasons.count("bad_dtype") == 1 and reasons.count("late") == 1, reasons
