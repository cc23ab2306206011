"""The round's long poll sleeps until a round of its block closes: it answers at once when one
does, and does not re-read the round on a timer meanwhile. The tests record each of the poll's
waits (how long it might sleep, and whether a closing round woke it), not the wall clock."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from blocktrain.protocol.http.longpoll import RoundSignal
from tests.protocol.conftest import auth, delta_body


@dataclass
class Waits:
    ended: list[tuple[float, bool]] = field(default_factory=list)
    """(the wait's timeout, whether a closing round woke it), one per wait as it ends."""
    started: threading.Event = field(default_factory=threading.Event)
    stretch: bool = False
    """Wait out no timeout: a wait then ends only when a round closes."""


@pytest.fixture
def waits(monkeypatch) -> Waits:
    """The long poll's waits, recorded (`RoundSignal.wait` is what the route sleeps in)."""
    log = Waits()
    original = RoundSignal.wait

    async def wait(event: asyncio.Event, timeout_s: float) -> None:
        log.started.set()
        await original(event, 60.0 if log.stretch else timeout_s)
        log.ended.append((timeout_s, event.is_set()))

    monkeypatch.setattr(RoundSignal, "wait", staticmethod(wait))
    return log


def test_a_long_poll_wakes_when_the_round_closes(harness, waits):
    waits.stretch = True
    w = harness.register(harness.alice, block=0)["worker_id"]
    harness.pull(harness.alice, w, 0)
    got: list[dict] = []

    def poll() -> None:
        r = harness.client.get(
            "/v1/blocks/0/round", params={"after": 0, "wait": 30}, headers=auth(harness.bob)
        )
        got.append(r.json())

    waiter = threading.Thread(target=poll)
    waiter.start()
    assert waits.started.wait(10), "the poll is waiting"
    assert not got
    r = harness.push(harness.alice, w, 0, delta_body(0, worker=w))  # the only replica: closes
    assert r.status_code == 200, r.text
    waiter.join(30)
    assert got and got[0]["round"] == 1
    assert waits.ended == [(1.0, True)], "one wait, ended by the closing round"


def test_a_waiting_long_poll_does_not_re_read_the_round_on_a_timer(harness, monkeypatch, waits):
    service = harness.service
    calls = []
    peek = service.peek
    monkeypatch.setattr(service, "peek", lambda block: calls.append(block) or peek(block))
    r = harness.client.get(
        "/v1/blocks/0/round", params={"after": 0, "wait": 1.5}, headers=auth(harness.alice)
    )
    assert r.status_code == 200 and r.json()["round"] == 0 and not r.json()["done"]
    assert waits.ended[0] == (1.0, False), "a read a second at most"
    assert not any(woken for _, woken in waits.ended), "no round closed: each wait ran out"
    # the poll reads the round once, then once after each wait: never on a timer of its own
    # (a 50 ms timer made 30 reads); 1.5 s of waits of up to 1 s each are two waits
    assert len(calls) == len(waits.ended) + 1 <= 3, (calls, waits.ended)
