"""Serving an ASGI app under uvicorn with limits that bad input cannot get past: the one place
where every server of the package (aggregator, block hosts, router) gets its socket, its
timeouts and its body caps.

    sock = bind(host, port)                      # a clear ConfigError if the port is taken
    app.add_middleware(HttpGuard, limits=limits, body_limit=..., error_body=...)
    run(app, sock, limits, tls=TlsFiles(cert, key))          # or ThreadedServer.start(...)

What is enforced, and where:

- a request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the previous response; a half-sent head is closed (uvicorn has no
  such timeout: `_protocol` adds it). Heads over `max_header_bytes` get 400 (h11).
- at most `max_connections` connections at once; a request beyond it gets 503 (uvicorn's
  `limit_concurrency`). Idle keep-alive connections close after `keep_alive_s`.
- at most `max_connections_per_address` of them from one client address (default a quarter
  of `max_connections`): a connection beyond it is answered 503 and closed as it opens, so one
  address that keeps re-opening half-sent heads cannot hold every slot (`_protocol`).
- `HttpGuard`, a pure-ASGI middleware: a request body is refused with 413 when its
  Content-Length exceeds the route's cap, before the app runs, and while streaming when a
  chunked body grows past it; a Content-Length that is not a plain decimal number, or one
  over 2**62, gets 400 (never a 500). A body must keep coming at `min_body_rate` bytes/s
  after a grace of `body_grace_s` (408 otherwise). The app sees a disconnect; the guard
  answers, with `Connection: close`.
- `TokenBucket`: requests per client (a token, an address) at a rate, after a burst; each
  server turns its refusal into its own 429.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from blocktrain.errors import ConfigError
from blocktrain.tls import TlsFiles, check_tls

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_CONTENT_LENGTH = 2**62
"""A declared length above this is nonsense for any route (and would overflow the ledger's
64-bit counters): 400 before anything else looks at it."""

BODY_BYTES = "body_bytes"
"""Key in the ASGI scope's "state" (`request.state.body_bytes`): the body bytes the app has
been handed so far, for byte accounting that counts what arrived, not what was declared."""
GUARD_REFUSAL = "guard_refusal"
"""Key in the scope's "state": (code, detail) once the guard has cut the body off; the app,
which then sees a disconnect, can tell why (its response is dropped: the guard answers)."""


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
    keep_alive_s: int = 30
    max_header_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("max_body", "max_connections", "keep_alive_s", "max_header_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        if self.max_connections_per_address is not None and self.max_connections_per_address <= 0:
            raise ConfigError(
                "max_connections_per_address must be positive, not "
                f"{self.max_connections_per_address}"
            )
        for name in ("header_timeout_s", "body_grace_s", "min_body_rate"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")

    @property
    def per_address(self) -> int:
        """Connections at once from one client address."""
        if self.max_connections_per_address is not None:
            return self.max_connections_per_address
        return max(1, self.max_connections // 4)


def default_error_body(code: str, detail: str) -> dict[str, Any]:
    return {"error": code, "detail": detail}


# ---------------------------------------------------------------------------------------------
# The request rate
# ---------------------------------------------------------------------------------------------


class TokenBucket:
    """Request rates per client, the one token bucket of every server: a client (a token id,
    an address: any hashable key) may send `burst` requests at once, then `rate_per_s` a
    second. Each server turns a refusal into its own error (the aggregator's 429
    `rate_limited`, the router's OpenAI-style 429), with the wait as its Retry-After.

    Buckets live in memory (a restart refills them). Once `max_keys` are held, those that have
    refilled are forgotten (a full bucket is the same as none), so idle clients cost no memory.
    Thread-safe; `clock` is monotonic seconds."""

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
    """A request's body in one buffer allocated at its declared Content-Length (which the
    guard has held to the route's cap), each chunk copied once, into place: parsers then read
    it through views (`tensorwire.decode`) and never copy it again. A body without a declared
    length (chunked) grows as it comes."""
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
    """Pure-ASGI middleware: body caps (declared and streamed) and a minimum body rate.

    `body_limit(scope)` gives a route's cap in bytes (default: `limits.max_body`);
    `error_body(code, detail)` shapes the JSON of the guard's own 400/408/413 answers (codes
    `bad_request`, `slow_client`, `too_large`); `on_refuse(scope, code)` is told of each, for
    counters. Add it with `app.add_middleware(HttpGuard, limits=..., ...)`."""

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
                if expects_body and not body.complete:
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


# ---------------------------------------------------------------------------------------------
# The server: a socket bound beforehand, uvicorn with the limits
# ---------------------------------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} must lie in 0..65535")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto = IPPROTO_TCP, not 0: asyncio switches Nagle off (TCP_NODELAY) only on sockets
        # that say they are TCP, and with Nagle on, a response written in two parts waits for
        # the client's delayed ACK: 40 ms per request on loopback.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "choose another --port or --host"
        ) from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket, *, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


_TOO_MANY = b"too many connections from this address\n"
TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s"
    % (len(_TOO_MANY), _TOO_MANY)
)
"""The answer to a connection over its address's share, sent as it opens: no request is read."""


def _protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's head: uvicorn times out only
    idle keep-alive connections, so a client that opens a connection and sends half a request
    line would hold it (and a slot of `limit_concurrency`) forever. And with a share of the
    connections per client address: one server's protocols count their peers' addresses (all
    run on the server's event loop), and a connection beyond `limits.per_address` is answered
    503 and closed before anything is read."""
    header_timeout_s = limits.header_timeout_s
    per_address = limits.per_address
    open_from: dict[str, int] = {}

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _address: str | None = None
        _refused: bool = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            address = self.client[0] if self.client else None
            if address is not None:
                if open_from.get(address, 0) >= per_address:
                    self._refused = True
                    transport.write(TOO_MANY_CONNECTIONS)
                    transport.close()
                    return
                open_from[address] = open_from.get(address, 0) + 1
                self._address = address
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # answered 503 as it opened: nothing it sends is read
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                if self._head_timer is None:  # the next request's head has begun
                    self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # uvicorn's keep-alive timeout covers the idle time until new data

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._address is not None:
                left = open_from.pop(self._address) - 1
                if left:
                    open_from[self._address] = left
                self._address = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11


def _config(
    app: Any, limits: Limits, tls: TlsFiles | None, *, verbose: bool = False
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http=_protocol(limits),
        log_level="debug" if verbose else "warning",
        access_log=False,
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        ssl_certfile=None if tls is None else tls.cert,
        ssl_keyfile=None if tls is None else tls.key,
    )


def run(
    app: Any,
    sock: socket.socket,
    limits: Limits | None = None,
    *,
    tls: TlsFiles | None = None,
    verbose: bool = False,
) -> None:
    """Serve until interrupted (blocking); uvicorn stops gracefully on SIGINT/SIGTERM."""
    check_tls(tls)
    uvicorn.Server(_config(app, limits or Limits(), tls, verbose=verbose)).run(sockets=[sock])


@dataclass
class ThreadedServer:
    """A uvicorn server in a background thread (tests and benchmarks on loopback)."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str

    @classmethod
    def start(
        cls,
        app: Any,
        sock: socket.socket,
        timeout_s: float = 10.0,
        *,
        limits: Limits | None = None,
        tls: TlsFiles | None = None,
    ) -> ThreadedServer:
        check_tls(tls)
        server = uvicorn.Server(_config(app, limits or Limits(), tls))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return cls(server, thread, url_of(sock, tls=tls is not None))

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
