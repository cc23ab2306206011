"""The listening side of every server of the package: a socket bound beforehand (`bind`) and
uvicorn serving an app on it (`run`, or `ThreadedServer`), under the connection limits of
`httpserve.Limits` (docs/protocol.md, Limits):

- a request's head must arrive within `header_timeout_s` (uvicorn has no such timeout:
  `_protocol` adds it); heads over `max_header_bytes` get 400; at most `max_connections` at
  once (503 beyond); idle keep-alive connections close after `keep_alive_s`.
- at most `max_connections_per_address` from one address, `max_connections_per_prefix` from one
  /24 or /64, and `max_anonymous_connections` waiting for a head without having shown a valid
  token: four addresses of 128 half-sent heads held all 512 slots before
  (bench/live_attacks.py, halfopen_4_addresses). A refused connection is answered 503 and
  closed as it opens, after `tarpit_s`, so a flood churns one per connection per tarpit_s.
  A newcomer past a cap takes the place of the longest-waiting anonymous connection of whoever
  holds the most, so an honest client is never locked out by a flood from elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from blocktrain.errors import ConfigError
from blocktrain.httpserve import AUTHENTICATED, Limits, prefix_of
from blocktrain.tls import TlsFiles, check_tls


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


_TOO_MANY = b"too many connections at once: from this address, its network, or without a token\n"
TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s"
    % (len(_TOO_MANY), _TOO_MANY)
)
"""The answer to a connection over its address's share, or its prefix's or the anonymous pool's
with no room to make (after `Limits.tarpit_s`): no request is read."""


def held_refusals(limits: Limits) -> int:
    """Refused connections held at once for their tarpit: twice `max_connections`, within the
    file descriptors the process may open beside the connections it serves."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = soft - limits.max_connections - 64 if soft != resource.RLIM_INFINITY else 1 << 20
    return max(0, min(2 * limits.max_connections, spare))


def _protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's head (a half-sent request line
    would hold a slot forever), and the caps per address, per prefix and on the anonymous pool;
    a refused connection is answered 503 and closed before anything is read."""
    header_timeout_s = limits.header_timeout_s
    per_address, per_prefix = limits.per_address, limits.per_prefix
    most_anonymous = limits.anonymous
    open_from: dict[str, int] = {}
    """address -> connections served."""
    open_in: dict[str, int] = {}
    """prefix -> connections served."""
    anonymous: dict[GuardedH11, None] = {}
    """The anonymous pool, the longest waiting first (a dict: ordered, O(1) removal)."""
    held: set[GuardedH11] = set()
    most_held = held_refusals(limits) if limits.tarpit_s > 0 else 0

    def admit(address: str, prefix: str) -> bool:
        """Whether a new connection from `address` is served: within its address's share, and
        within its prefix's and the anonymous pool's, or room made there by displacing one."""
        if open_from.get(address, 0) >= per_address:
            return False
        prefix_full = open_in.get(prefix, 0) >= per_prefix
        if not prefix_full and len(anonymous) < most_anonymous:
            return True
        victim = heaviest(prefix if prefix_full else None)
        if victim is None or not holds_more(victim, address, prefix):
            return False
        victim.displace()
        return True

    def heaviest(prefix: str | None) -> GuardedH11 | None:
        """The longest-waiting anonymous connection of the prefix holding the most
        connections, and within it of the address holding the most (in `prefix` alone, when
        given)."""
        best, most = None, (0, 0)
        for conn in anonymous:  # the longest waiting first: it wins ties
            if prefix is not None and conn.prefix != prefix:
                continue
            weight = (open_in[conn.prefix], open_from[conn.address])
            if weight > most:
                best, most = conn, weight
        return best

    def holds_more(victim: GuardedH11, address: str, prefix: str) -> bool:
        """Whether `victim`'s holder keeps at least as many connections as the newcomer's once one is
        displaced: a margin of two, so that two holders never take turns displacing each other."""
        if victim.prefix != prefix:
            return open_in[victim.prefix] >= open_in.get(prefix, 0) + 2
        return open_from[victim.address] >= open_from.get(address, 0) + 2

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        address: str = ""
        prefix: str = ""
        _served: bool = False
        """Counted in the books (open_from, open_in), until it closes or is displaced."""
        _holder: bool = False
        """A request of this connection presented a valid token: never anonymous again."""
        _refused: bool = False
        _hold: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple | list) and peer else "unknown"
            prefix = prefix_of(address)
            if not admit(address, prefix):
                # refused before uvicorn counts it among its connections: those are what
                # limit_concurrency (max_connections) counts, and one accept batch of a client
                # re-opening connections as fast as it can holds hundreds not yet closed
                self._refused = True
                self.transport = transport
                transport.pause_reading()
                if len(held) < most_held:
                    held.add(self)
                    self._hold = self.loop.call_later(limits.tarpit_s, self._refuse)
                else:
                    self._refuse()
                return
            super().connection_made(transport)
            self.address, self.prefix, self._served = address, prefix, True
            open_from[address] = open_from.get(address, 0) + 1
            open_in[prefix] = open_in.get(prefix, 0) + 1
            anonymous[self] = None
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
                anonymous.pop(self, None)  # in a request: it waits for nothing

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # uvicorn's keep-alive timeout covers the idle time until new data
            scope = self.scope or {}
            self._holder = self._holder or bool(scope.get("state", {}).get(AUTHENTICATED))
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if self._served and waiting and not self._holder:
                anonymous[self] = None  # at the end: the newest to wait

        def displace(self) -> None:
            """Close this anonymous connection for a newcomer, as its head timeout (or its
            keep-alive timeout) would have, later."""
            self._forget()
            self.transport.close()

        def _forget(self) -> None:
            anonymous.pop(self, None)
            if not self._served:
                return
            self._served = False
            for books, key in ((open_from, self.address), (open_in, self.prefix)):
                left = books.pop(key) - 1
                if left:
                    books[key] = left

        def _refuse(self) -> None:
            held.discard(self)
            self._hold = None
            if not self.transport.is_closing():
                self.transport.write(TOO_MANY_CONNECTIONS)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:  # uvicorn never saw it
                if self._hold is not None:  # the client left during its tarpit
                    self._hold.cancel()
                    self._refuse()
                return
            self._disarm()
            self._forget()
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
    """Serve until interrupted (blocking): uvicorn stops gracefully on SIGINT (Ctrl+C) or
    SIGTERM, and this returns, so that the command exits 0."""
    check_tls(tls)
    server = uvicorn.Server(_config(app, limits or Limits(), tls, verbose=verbose))
    with _stopped_by_signals():
        server.run(sockets=[sock])


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """uvicorn catches SIGINT and SIGTERM while it serves, then raises the signal again: no-op
    handlers meanwhile let the serving command return; the previous ones come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
