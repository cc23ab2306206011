"""The limits every server of the package (aggregator, block hosts, router) holds a client to,
written once (`Limits`); `blocktrain.listener` binds the socket and runs uvicorn under them.

- `HttpGuard`, a pure-ASGI middleware: a body over its route's cap gets 413 (declared, before
  the app runs, or while streaming), a Content-Length that is not a plain number 400 (never a
  500), a body slower than `min_body_rate` after `body_grace_s` 408; the guard answers, with
  `Connection: close`, and holds every 429 for `Limits.tarpit_s`.
- `TokenBucket`: requests per client (a token, an address) at a rate, after a burst.
- `FailedAuth`: failed token checks per address and per prefix (`prefix_of`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from blocktrain.errors import ConfigError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_CONTENT_LENGTH = 2**62
"""A declared length above this is nonsense (it would overflow the ledger's counters): 400."""

# keys in the ASGI scope's "state"
BODY_BYTES = "body_bytes"
"""The body bytes the app has been handed so far (accounting counts what arrived)."""
GUARD_REFUSAL = "guard_refusal"
"""(code, detail) once the guard cut the body off (the app sees a disconnect; the guard answers)."""
AUTHENTICATED = "authenticated"
"""True once the app found a valid token: the listener takes the connection out of the
anonymous pool for good."""


def mark_authenticated(scope: Scope) -> None:
    """Tell the listener that this request's connection belongs to a token holder."""
    scope.setdefault("state", {})[AUTHENTICATED] = True


def prefix_of(address: str) -> str:
    """The network a client address is counted in beside itself: its /24 (IPv4) or its /64
    (IPv6: one host is handed a whole /64). What is no address is its own prefix."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False))


@dataclass(frozen=True)
class Limits:
    """What one server tolerates from a client. The defaults suit JSON APIs; a route with
    large bodies raises its own cap through `HttpGuard(body_limit=...)`."""

    max_body: int = 64 * 1024
    """Bytes of a request body, for routes without a cap of their own."""
    header_timeout_s: float = 10.0
    """A request's head must arrive within this many seconds."""
    body_grace_s: float = 30.0
    min_body_rate: float = 16 * 1024
    """After `body_grace_s`, a body must have arrived at this average rate (bytes/s)."""
    max_connections: int = 512
    max_connections_per_address: int | None = None
    """Connections at once from one client address; None: a quarter of `max_connections`."""
    max_connections_per_prefix: int | None = None
    """Connections at once from one /24 (IPv4) or /64 (IPv6) (`prefix_of`); None: half of
    `max_connections`, and at least the share of one address."""
    max_anonymous_connections: int | None = None
    """Connections at once waiting for a request's head that never showed a valid token; None:
    half of `max_connections`, so that half-sent heads never take the slots of token holders."""
    keep_alive_s: int = 30
    max_header_bytes: int = 64 * 1024
    failed_auth_burst: int = 20
    failed_auth_per_s: float = 0.5
    """Failed token checks from one address: `failed_auth_burst` at once, then this many a
    second; from one prefix four times both (`FailedAuth`)."""
    tarpit_s: float = 1.0
    """How long a 429 (at most its Retry-After) or a connection over its share (listener) waits
    before its refusal is sent: a flood gets one answer per connection per `tarpit_s`, not a
    core of the server's time (bench/live_attacks.py). 0: at once."""

    def __post_init__(self) -> None:
        for name in ("max_body", "max_connections", "keep_alive_s", "max_header_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("header_timeout_s", "body_grace_s", "min_body_rate"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        for name in (
            "max_connections_per_address",
            "max_connections_per_prefix",
            "max_anonymous_connections",
        ):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        if self.failed_auth_burst < 1 or not (
            self.failed_auth_per_s > 0 and math.isfinite(self.failed_auth_per_s)
        ):
            raise ConfigError(
                f"failed_auth_burst ({self.failed_auth_burst}) and failed_auth_per_s "
                f"({self.failed_auth_per_s}) must be positive"
            )
        if not 0 <= self.tarpit_s <= 60:
            raise ConfigError(f"tarpit_s must lie in 0..60 seconds, not {self.tarpit_s}")

    @property
    def per_address(self) -> int:
        """Connections at once from one client address."""
        if self.max_connections_per_address is not None:
            return self.max_connections_per_address
        return max(1, self.max_connections // 4)

    @property
    def per_prefix(self) -> int:
        """Connections at once from one prefix (`prefix_of`)."""
        if self.max_connections_per_prefix is not None:
            return self.max_connections_per_prefix
        return max(self.per_address, self.max_connections // 2)

    @property
    def anonymous(self) -> int:
        """Connections at once in the anonymous pool."""
        if self.max_anonymous_connections is not None:
            return self.max_anonymous_connections
        return max(1, self.max_connections // 2)


def default_error_body(code: str, detail: str) -> dict[str, Any]:
    return {"error": code, "detail": detail}


# ---------------------------------------------------------------------------------------------
# The request rate
# ---------------------------------------------------------------------------------------------


class TokenBucket:
    """Request rates per client (any hashable key): `burst` requests at once, then `rate_per_s`
    a second; each server turns a refusal into its own 429. In memory and thread-safe; past
    `max_keys` the refilled buckets are forgotten (a full bucket is the same as none)."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_keys: int = 10_000,
    ) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)) or burst < 1 or max_keys < 1:
            raise ConfigError(
                f"a rate of {rate_per_s} requests/s in bursts of {burst} (for up to "
                f"{max_keys} clients): each must be positive"
            )
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._buckets: dict[Hashable, tuple[float, float]] = {}
        """key -> (requests left, time they were counted)."""

    def _left(self, key: Hashable, now: float) -> float:
        left, then = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), left + max(now - then, 0.0) * self.rate_per_s)

    def wait(self, key: Hashable) -> float:
        """The seconds until `key` may take a request (0.0: now); takes nothing."""
        with self._lock:
            left = self._left(key, self.clock())
        return 0.0 if left >= 1.0 else (1.0 - left) / self.rate_per_s

    def take(self, key: Hashable) -> float:
        """Take one request from `key`'s bucket -> 0.0; or, when it is spent, take nothing and
        return the seconds until a request would be admitted (always > 0)."""
        now = self.clock()
        with self._lock:
            if len(self._buckets) >= self.max_keys:
                self._buckets = {
                    k: v for k, v in self._buckets.items() if self._left(k, now) < self.burst
                }
            left = self._left(key, now)
            if left < 1.0:
                self._buckets[key] = (left, now)
                return (1.0 - left) / self.rate_per_s
            self._buckets[key] = (left - 1.0, now)
            return 0.0


class FailedAuth:
    """Failed token checks per client address and (four times as many) per prefix. Past them
    every token check from there is refused, a valid token's too: a check that went on would go
    on answering guesses."""

    PREFIX_FACTOR = 4

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        rate, burst = limits.failed_auth_per_s, limits.failed_auth_burst
        self.by_address = TokenBucket(rate, burst, clock)
        self.by_prefix = TokenBucket(self.PREFIX_FACTOR * rate, self.PREFIX_FACTOR * burst, clock)

    def wait(self, address: str) -> float:
        """The seconds until a token from `address` may be checked (0.0: now)."""
        return max(self.by_address.wait(address), self.by_prefix.wait(prefix_of(address)))

    def failed(self, address: str) -> None:
        """A token from `address` was checked and is not valid."""
        self.by_address.take(address)
        self.by_prefix.take(prefix_of(address))

    def refusal(self, address: str, wait: float) -> str:
        """The words of the 429 a server answers while `wait` > 0."""
        return (
            f"too many failed token checks from {address} or its network; retry in "
            f"{math.ceil(wait)}s"
        )


# ---------------------------------------------------------------------------------------------
# The body guard
# ---------------------------------------------------------------------------------------------


@dataclass
class _Body:
    cap: int
    limits: Limits
    started: float = field(default_factory=time.monotonic)
    received: int = 0
    complete: bool = False
    failure: tuple[int, str, str] | None = None
    response_started: bool = False

    def deadline(self) -> float:
        return self.started + self.limits.body_grace_s + self.received / self.limits.min_body_rate


def declared_length(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, str | None]:
    """(Content-Length, None), (None, None) when absent, or (None, why) when unusable."""
    values = [v for k, v in headers if k.lower() == b"content-length"]
    if not values:
        return None, None
    text = values[0].strip()
    if len(values) > 1 or not text.isdigit():
        return None, "the Content-Length header is not one decimal number"
    if len(text) > 19 or int(text) > MAX_CONTENT_LENGTH:
        return None, f"the Content-Length {text[:30].decode()} is absurd"
    return int(text), None


async def read_body(scope: Scope, chunks: AsyncIterator[bytes]) -> bytearray:
    """A request's body in one buffer allocated at its declared Content-Length (held to the
    route's cap by the guard), each chunk copied once, into place (parsers read it through
    views); a chunked body grows as it comes."""
    length, _ = declared_length(scope["headers"])
    buf = bytearray(length or 0)
    pos = 0
    async for chunk in chunks:
        end = pos + len(chunk)
        if end <= len(buf):
            buf[pos:end] = chunk  # same length: in place
        else:
            buf[pos:] = chunk
        pos = end
    del buf[pos:]  # a body cut short
    return buf


class HttpGuard:
    """Body caps (declared and streamed) and a minimum body rate. `body_limit(scope)`: a route's
    cap; `error_body(code, detail)`: the JSON of the guard's 400/408/413 (`bad_request`,
    `slow_client`, `too_large`); `on_refuse(scope, code)` is told of each."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limits: Limits | None = None,
        body_limit: Callable[[Scope], int] | None = None,
        error_body: Callable[[str, str], dict[str, Any]] = default_error_body,
        on_refuse: Callable[[Scope, str], None] | None = None,
    ) -> None:
        self.app = app
        self.limits = limits or Limits()
        self.body_limit = body_limit
        self.error_body = error_body
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.limits.max_body if self.body_limit is None else self.body_limit(scope)
        scope.setdefault("state", {})[BODY_BYTES] = 0
        length, problem = declared_length(scope["headers"])
        if problem is not None:
            await self._answer(scope, send, 400, "bad_request", problem)
            return
        if length is not None and length > cap:
            await self._answer(
                scope,
                send,
                413,
                "too_large",
                f"the body declares {length} bytes; the limit is {cap}",
            )
            return
        body = _Body(cap, self.limits)
        chunked = any(k == b"transfer-encoding" for k, _ in scope["headers"])
        expects_body = chunked or bool(length)

        async def guarded_receive() -> Message:
            if body.failure is not None:
                return {"type": "http.disconnect"}
            if body.complete:
                return await receive()
            try:
                timeout = max(body.deadline() - time.monotonic(), 0.0)
                message = await asyncio.wait_for(receive(), timeout)
            except TimeoutError:
                body.failure = (
                    408,
                    "slow_client",
                    f"the body came slower than {self.limits.min_body_rate:.0f} bytes/s",
                )
                scope["state"][GUARD_REFUSAL] = body.failure[1:]
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                body.received += len(message.get("body", b""))
                scope["state"][BODY_BYTES] = body.received
                body.complete = not message.get("more_body", False)
                if body.received > cap:
                    body.failure = (413, "too_large", f"the body exceeds the limit of {cap} bytes")
                    scope["state"][GUARD_REFUSAL] = body.failure[1:]
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                if body.failure is not None:
                    return  # the guard answers instead
                body.response_started = True
                if message.get("status") == 429:
                    message = await self._tarpit(message)
                elif expects_body and not body.complete:
                    # an answer before the whole body (a refusal): close after it, or the
                    # server would wait to drain the body, as slowly as the client sends it
                    headers = [*message.get("headers", []), (b"connection", b"close")]
                    message = {**message, "headers": headers}
            elif not body.response_started:
                return
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            # what the app raises on the disconnect it was handed (ClientDisconnect) is ours
            if body.failure is None or body.response_started:
                raise
        if body.failure is not None and not body.response_started:
            await self._answer(scope, send, *body.failure)

    async def _tarpit(self, message: Message) -> Message:
        """A 429, sent `limits.tarpit_s` (at most its Retry-After) late, then the connection
        closes."""
        headers = list(message.get("headers", []))
        delay = self.limits.tarpit_s
        for key, value in headers:
            if key.lower() == b"retry-after" and value.strip().isdigit():
                delay = min(delay, float(value))
        if delay > 0:
            await asyncio.sleep(delay)
        if not any(key.lower() == b"connection" for key, _ in headers):
            headers.append((b"connection", b"close"))
        return {**message, "headers": headers}

    async def _answer(self, scope: Scope, send: Send, status: int, code: str, detail: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(scope, code)
        payload = json.dumps(self.error_body(code, detail)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),  # the rest of the body is never read
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
