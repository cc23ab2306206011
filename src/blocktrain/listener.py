"""The listening side of every server of the package: a socket bound beforehand (`bind`) and
uvicorn serving an app on it (`run`, or `ThreadedServer` for tests and benchmarks), under the
connection limits of `httpserve.Limits` (the body guard and the request rate are httpserve's):

- a request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the previous response; a half-sent head is closed (uvicorn has no
  such timeout: `_protocol` adds it). Heads over `max_header_bytes` get 400 (h11).
- at most `max_connections` connections at once; a request beyond it gets 503 (uvicorn's
  `limit_concurrency`). Idle keep-alive connections close after `keep_alive_s`.
- at most `max_connections_per_address` of them from one client address (default a quarter
  of `max_connections`): a connection beyond it is answered 503 and closed as it opens, so one
  address that keeps re-opening half-sent heads cannot hold every slot (`_protocol`); nor
  does a refused connection count against `max_connections`, however many are refused at once.
  The 503 waits `tarpit_s`, the connection held unread meanwhile (up to `held_refusals` of
  them; beyond, it is sent at once): a client that re-opens each refused connection at once
  then churns one per connection per tarpit_s, not as fast as it can (tens of thousands a
  second on loopback, a core of the server's time).
"""

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
from blocktrain.httpserve import Limits
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


_TOO_MANY = b"too many connections from this address\n"
TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s"
    % (len(_TOO_MANY), _TOO_MANY)
)
"""The answer to a connection over its address's share (after `Limits.tarpit_s`): no request is
read."""


def held_refusals(limits: Limits) -> int:
    """Refused connections held at once for their tarpit: twice `max_connections`, within the
    file descriptors the process may open beside the connections it serves."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = soft - limits.max_connections - 64 if soft != resource.RLIM_INFINITY else 1 << 20
    return max(0, min(2 * limits.max_connections, spare))


def _protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's head: uvicorn times out only
    idle keep-alive connections, so a client that opens a connection and sends half a request
    line would hold it (and a slot of `limit_concurrency`) forever. And with a share of the
    connections per client address: one server's protocols count their peers' addresses (all
    run on the server's event loop), and a connection beyond `limits.per_address` is answered
    503 and closed before anything is read, `limits.tarpit_s` after it opened."""
    header_timeout_s = limits.header_timeout_s
    per_address = limits.per_address
    open_from: dict[str, int] = {}
    held: set[GuardedH11] = set()
    most_held = held_refusals(limits) if limits.tarpit_s > 0 else 0

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _address: str | None = None
        _refused: bool = False
        _hold: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple | list) and peer else None
            if address is not None and open_from.get(address, 0) >= per_address:
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
            if address is not None:
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
    """Serve until interrupted (blocking): uvicorn stops gracefully on SIGINT (Ctrl+C) or
    SIGTERM, and this returns, so that the command exits 0."""
    check_tls(tls)
    server = uvicorn.Server(_config(app, limits or Limits(), tls, verbose=verbose))
    with _stopped_by_signals():
        server.run(sockets=[sock])


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """uvicorn catches SIGINT and SIGTERM while it serves, shuts down, then raises the signal
    again to the handler it found: Python's own made Ctrl+C a KeyboardInterrupt (`blocktrain:
    interrupted`, exit 130) and SIGTERM a kill (exit -15) after a clean stop. No-op handlers
    meanwhile let the serving command return; the previous ones come back after."""
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
