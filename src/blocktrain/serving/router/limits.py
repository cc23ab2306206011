"""The router's admission limits: requests per client per minute, and work per request and in
flight, refused before any host computes (docs/serving.md, "Trust: authentication and limits").
Work is counted in bytes x steps_per_block (`work_units`): the chain's compute grows with both,
so a cap on units caps a request's compute whatever its shape.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from blocktrain.httpserve import TokenBucket
from blocktrain.serving.shared.serving_errors import BadRequest, TooManyRequests, send_error

T = TypeVar("T")


CLIENT_GONE = 499
"""The status of an answer nobody waits for (nginx's "client closed request"): never seen."""


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


async def while_connected(receive: Receive, work: Awaitable[T]) -> T:
    """`work`, run until it ends or the client hangs up: then it is cancelled (ClientGone), so
    that a request nobody waits for frees its work in flight. For a route that has read its
    whole body (what `receive` gives next is the disconnect)."""

    async def hung_up() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    if task.cancelled():
        raise ClientGone
    return task.result()


CLIENT_TOKEN = "client_token"
"""Key in the scope's "state": the request's token (a prefix of its digest), put there by
`client_tokens.RequireToken` when the router takes tokens."""


def client_address(scope: Scope) -> str:
    """The request's peer's address: what the rate limit counts."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def holder_of(scope: Scope) -> tuple[str, str | None]:
    """Whom the work limits count a request against: (its token, its address) when the router
    takes tokens, else (its address, None). The first is the client of the fair share."""
    token = scope.get("state", {}).get(CLIENT_TOKEN)
    address = client_address(scope)
    return (f"token {token}", address) if token else (address, None)


def work_units(n_bytes: int, steps_per_block: int) -> int:
    """The work of one request: bytes to generate x sampler points per block."""
    return n_bytes * steps_per_block


def per_minute(requests: int, clock: Callable[[], float]) -> TokenBucket:
    """The router's rate limit: `requests` a minute per client address, in bursts of up to as
    many."""
    return TokenBucket(requests / 60.0, requests, clock)


def check_rate(bucket: TokenBucket, client: str) -> None:
    """Take one request's token for `client`, or raise TooManyRequests."""
    wait = bucket.take(client)
    if wait:
        raise TooManyRequests(
            f"more than {bucket.burst:g} requests a minute from {client}; retry later",
            retry_after_s=wait,
        )


@dataclass
class WorkLimiter:
    """Caps the work of one request (422), of one client's requests in flight, and of all
    requests in flight (429), shared fairly (docs/serving.md, "Trust: authentication and
    limits": `max_work_in_flight`, `max_work_per_client`). The fair share lets clients that fill
    the budget from many addresses delay a newcomer by a piece instead of refusing it
    (bench/live_attacks.py, unread_streams_4_addresses: 429 on 118 of 118 before)."""

    per_request: int
    in_flight_max: int
    in_flight: int = 0
    per_client: int | None = None
    """Work in flight of one client (address) at once; None: no share but the whole."""
    by_client: dict[str, int] = field(default_factory=dict)
    by_address: dict[str, int] = field(default_factory=dict)
    """Work in flight per address, of the requests whose client is a token."""

    def admit(
        self, units: int, what: str, param: str, client: str = "", address: str | None = None
    ) -> int:
        """Count `units` of work in flight for `client` (and for `address`, when the client is
        a token: `holder_of`) -> the units to `release` when the request ends; `what` says how
        the units were counted, `param` what the client should change."""
        if units > self.per_request:
            raise BadRequest(
                f"{what} = {units} units of work exceeds this router's limit of "
                f"{self.per_request} per request; ask for fewer bytes or steps",
                param=param,
                code="too_much_work",
                status=422,
            )
        held = self.by_client.get(client, 0)
        self._check_share(client, held, units)
        if address is not None:
            self._check_share(address, self.by_address.get(address, 0), units)
        if self.in_flight + units > self.in_flight_max and not self._within_fair_share(
            client, held + units
        ):
            raise TooManyRequests(
                f"the router is busy: {self.in_flight} units of work in flight, "
                f"{units} more would pass its limit of {self.in_flight_max}; retry shortly",
                retry_after_s=1.0,
                code="busy",
            )
        self.in_flight += units
        self.by_client[client] = held + units
        if address is not None:
            self.by_address[address] = self.by_address.get(address, 0) + units
        return units

    def _check_share(self, who: str, held: int, units: int) -> None:
        if self.per_client is not None and held + units > self.per_client:
            raise TooManyRequests(
                f"the router is busy for {who or 'this client'}: {held} units of its work in "
                f"flight, {units} more would pass its share of {self.per_client} (of "
                f"{self.in_flight_max} for all clients); retry when one of its requests ends",
                retry_after_s=1.0,
                code="busy",
            )

    def _within_fair_share(self, client: str, held: int) -> bool:
        """Whether `client`, holding `held` units, stays within its fair share (and the work in
        flight within twice the budget): then it is admitted over a full budget."""
        holders = len(self.by_client) + (client not in self.by_client)
        over = self.in_flight + held - self.by_client.get(client, 0)
        return held <= self.in_flight_max / holders and over <= 2 * self.in_flight_max

    def should_yield(self, client: str) -> bool:
        """Whether `client` should pause before its next piece: the work in flight is over the
        budget and `client` holds more than its share and more than the smallest holder (who
        always goes on, so that some work always ends)."""
        if self.in_flight <= self.in_flight_max:
            return False
        held = self.by_client.get(client, 0)
        fair = self.in_flight_max / max(len(self.by_client), 1)
        return held > fair and held > min(self.by_client.values())

    def park(self, units: int) -> None:
        """Admitted units that compute nothing for now (a stream nobody reads) leave the work in
        flight but stay in their client's share, so that a client cannot have stream after
        unread stream admitted."""
        self.in_flight -= units

    def unpark(self, units: int) -> bool:
        """Count parked units in flight again if they fit -> whether they did."""
        if self.in_flight + units > self.in_flight_max:
            return False
        self.in_flight += units
        return True

    def release(
        self, units: int, client: str = "", parked: bool = False, address: str | None = None
    ) -> None:
        if not parked:
            self.in_flight -= units
        for books, key in ((self.by_client, client), (self.by_address, address)):
            if key is None:
                continue
            left = books.pop(key, 0) - units
            if left > 0:
                books[key] = left


class RateLimit:
    """ASGI middleware: the rate limit on POST requests (the generation routes), checked
    before the body is read."""

    def __init__(self, app: ASGIApp, limiter: TokenBucket | None) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.limiter is not None and scope["type"] == "http" and scope["method"] == "POST":
            try:
                check_rate(self.limiter, client_address(scope))
            except TooManyRequests as err:
                await send_error(send, err, scope)
                return
        await self.app(scope, receive, send)
