"""Adaptive pacing over HTTP (issue 30): the round's pull tells each worker its local steps
(`X-Local-Steps`), a push over them is refused, and a restart weighs the votes alike."""

from __future__ import annotations

import pytest

from blocktrain.protocol.core.bodies import decode
from tests.protocol.conftest import SETTINGS, Harness, auth, delta_body, make_harness

ADAPTIVE = SETTINGS.replace(pacing="adaptive", local_steps=8, deadline_s=30.0)


@pytest.fixture
def h(tmp_path):
    harness = make_harness(tmp_path / "s", ADAPTIVE)
    yield harness
    harness.state.close()


def pull_steps(h: Harness, token: str, worker: int, *, redirect: bool = False) -> int:
    r = h.client.get(
        "/v1/blocks/0",
        params={"redirect": 1} if redirect else None,
        headers=auth(token, worker),
        follow_redirects=False,
    )
    assert r.status_code == (303 if redirect else 200), r.text
    if not redirect:  # the body's local_steps stays H: it is the same for every worker
        assert decode(r.content).metadata["local_steps"] == str(h.service.settings.local_steps)
    return int(r.headers["X-Local-Steps"])


def body(h: Harness, worker: int, steps: int, scale: float = 0.01) -> bytes:
    rounds = h.service.blocks[0].rounds
    return delta_body(
        0, base_version=rounds.version, round=rounds.round, worker=worker, steps=steps, scale=scale
    )


def test_the_pull_tells_each_worker_its_steps_and_a_push_over_them_is_refused(h):
    fast = h.register(h.alice, block=0)["worker_id"]
    slow = h.register(h.bob, block=0)["worker_id"]
    assert pull_steps(h, h.alice, fast) == 8, "no reading yet: H"
    assert pull_steps(h, h.bob, slow, redirect=True) == 8
    h.clock.advance(8.0)  # 1 s a step
    assert h.push(h.alice, fast, 0, body(h, fast, 8)).status_code == 200
    h.clock.advance(32.0)  # 5 s a step: past the deadline
    late = h.push(h.bob, slow, 0, body(h, slow, 8))
    assert late.status_code == 409 and late.json()["reason"] == "late"
    # round 1 opened at the deadline; its clock starts at its first pull: 30 s left
    assert pull_steps(h, h.alice, fast) == 8, "0.8 x 30 / 1 = 24: clamped to H"
    assert pull_steps(h, h.bob, slow, redirect=True) == 4, "floor(0.8 x 30 / 5)"
    h.clock.advance(20.0)
    ok = h.push(h.bob, slow, 0, body(h, slow, 4))
    assert ok.status_code == 200 and ok.json()["accepted"], ok.text
    [entry] = h.service.blocks[0].acc.entries.values()  # the round waits for fast's update
    assert entry.weight == pytest.approx(4 / 8), "its vote weighs its steps: 4 of H = 8"
    h2 = h.reopen()  # a restart reads the pending body back: the same weight
    try:
        [again] = h2.service.blocks[0].acc.entries.values()
        assert again.weight == pytest.approx(4 / 8)
        over = h2.push(h.alice, fast, 0, body(h2, fast, 9))
        assert over.status_code == 400 and over.json()["reason"] == "bad_metadata"
        assert "told 8" in over.json()["detail"]
    finally:
        h2.state.close()
        h.state = h2.state  # closed once by the fixture as well (idempotent)


def test_fixed_pacing_tells_every_worker_h(tmp_path):
    h = make_harness(tmp_path / "s")
    try:
        w = h.register(h.alice, block=0)["worker_id"]
        assert pull_steps(h, h.alice, w) == SETTINGS.local_steps == 2
    finally:
        h.state.close()
