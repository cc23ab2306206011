"""The round's long poll sleeps until a round of its block closes: it answers at once when one
does, and does not re-read the round on a timer meanwhile."""

from __future__ import annotations

import threading
import time

from .conftest import auth, delta_body


def test_a_long_poll_wakes_when_the_round_closes(harness):
    w = harness.register(harness.alice, block=0)["worker_id"]
    harness.pull(harness.alice, w, 0)
    got: list[dict] = []

    def poll() -> None:
        r = harness.client.get(
            "/v1/blocks/0/round", params={"after": 0, "wait": 30}, headers=auth(harness.bob)
        )
        got.append(r.json())

    waiter = threading.Thread(target=poll)
    started = time.monotonic()
    waiter.start()
    time.sleep(0.3)  # the poll is waiting
    assert not got
    r = harness.push(harness.alice, w, 0, delta_body(0, worker=w))  # the only replica: closes
    assert r.status_code == 200, r.text
    waiter.join(10)
    assert got and got[0]["round"] == 1
    assert time.monotonic() - started < 10  # not the 30 s the poll may wait


def test_a_waiting_long_poll_does_not_re_read_the_round_on_a_timer(harness, monkeypatch):
    service = harness.service
    calls = []
    peek = service.peek
    monkeypatch.setattr(service, "peek", lambda block: calls.append(block) or peek(block))
    started = time.monotonic()
    r = harness.client.get(
        "/v1/blocks/0/round", params={"after": 0, "wait": 1.5}, headers=auth(harness.alice)
    )
    assert r.status_code == 200 and r.json()["round"] == 0
    assert 1.4 < time.monotonic() - started < 5
    assert len(calls) <= 3, calls  # a read a second at most (a 50 ms timer made 30)
