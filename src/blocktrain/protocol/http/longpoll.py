"""Long polls of a block's round (`GET /v1/blocks/{b}/round?after=R&wait=S`) that sleep until
the round changes, instead of re-reading it on a timer: 1,000 waiting workers re-reading every
50 ms cost the aggregator 20,000 look-ups a second while nothing happened."""

from __future__ import annotations

import asyncio
import contextlib

MAX_WAIT_S = 60.0
"""The longest a long poll is held."""


class RoundSignal:
    """Wakes the long polls of a block when one of its rounds closes. `notify` may be called
    from any thread (rounds close in worker threads); waiting happens on the event loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[int, asyncio.Event] = {}

    def event(self, block: int) -> asyncio.Event:
        """The event the next change of `block` sets: take it before reading the round, so
        that a change between the read and the wait is not missed."""
        self._loop = asyncio.get_running_loop()
        return self._events.setdefault(block, asyncio.Event())

    def notify(self, block: int) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, block)

    def _wake(self, block: int) -> None:
        event = self._events.pop(block, None)
        if event is not None:
            event.set()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
