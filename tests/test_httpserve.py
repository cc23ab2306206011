"""The shared HTTP limits (`blocktrain.httpserve`, `blocktrain.listener`): body caps before and while streaming, slow
bodies, half-sent heads: what a client sends cannot exhaust a server before it is parsed."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response

from blocktrain.errors import ConfigError
from blocktrain.httpserve import (
    FailedAuth,
    HttpGuard,
    Limits,
    TokenBucket,
    declared_length,
    mark_authenticated,
    prefix_of,
)
from blocktrain.listener import ThreadedServer, bind
from tests.asgi import asgi_request


def echo_app(limits: Limits, **guard: Any) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @app.post("/refuse")
    async def refuse() -> dict[str, str]:  # answers without reading the body, as a 401 does
        return {"refused": "before the body"}

    @app.post("/limited")
    async def limited(request: Request) -> Response:  # a client past its rate
        wait = request.headers.get("x-retry-after", "5")
        return Response(b"slow down", status_code=429, headers={"retry-after": wait})

    app.add_middleware(HttpGuard, limits=limits, **guard)
    return app


def call(app: Any, headers: dict[str, str], chunks: list[bytes], delay_s: float = 0.0):
    """Run one POST /echo through the ASGI app; (status, JSON, chunks the app pulled)."""
    answer = asgi_request(app, "POST", "/echo", headers, chunks, delay_s=delay_s)
    return answer.status, json.loads(answer.body), answer.chunks_pulled


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, (None, None)),
        ("12", (12, None)),
        ("99999999999999999999", (None, "absurd")),
        ("-1", (None, "decimal")),
        ("1e3", (None, "decimal")),
    ],
)
def test_declared_length(value, want):
    headers = [] if value is None else [(b"content-length", value.encode())]
    got = declared_length(headers)
    assert got[0] == want[0]
    assert (got[1] is None) if want[1] is None else (want[1] in got[1])


def test_a_declared_body_over_the_cap_is_refused_before_the_app_reads_a_byte():
    """Finding: `POST /v1/workers` parsed an unbounded body (300 MB took 1.2 GB of memory)."""
    status, doc, pulled = call(
        echo_app(Limits(max_body=1000)), {"content-length": str(300 * 2**20)}, [b"x" * 1000] * 5
    )
    assert status == 413 and doc["error"] == "too_large", doc
    assert pulled == 0


def test_an_absurd_content_length_is_a_400_not_a_500():
    """Finding: `Content-Length: 99999999999999999999` made the aggregator answer 500."""
    status, doc, pulled = call(
        echo_app(Limits()), {"content-length": "99999999999999999999"}, [b"x"]
    )
    assert status == 400 and doc["error"] == "bad_request" and pulled == 0, doc


def test_a_chunked_body_is_cut_at_the_cap_while_streaming():
    """Finding (serving): chunked uploads bypassed the hosts' limit; the guard counts bytes."""
    refused: list[str] = []
    app = echo_app(Limits(max_body=2500), on_refuse=lambda scope, code: refused.append(code))
    status, doc, pulled = call(app, {}, [b"x" * 1000] * 100)
    assert status == 413 and doc["error"] == "too_large", doc
    assert pulled == 3, "the guard stops reading at the first chunk over the cap"
    assert refused == ["too_large"]
    status, doc, _ = call(app, {}, [b"x" * 1000] * 2)
    assert status == 200 and doc == {"bytes": 2000}


def test_a_body_slower_than_the_minimum_rate_gets_408():
    app = echo_app(Limits(body_grace_s=0.2, min_body_rate=1000.0), error_body=lambda c, d: {"r": c})
    started = time.monotonic()
    status, doc, pulled = call(app, {}, [b"x"] * 1000, delay_s=0.05)
    assert status == 408 and doc == {"r": "slow_client"}, doc
    assert time.monotonic() - started < 2.0 and pulled < 20


def test_limits_refuse_nonsense():
    with pytest.raises(ConfigError, match="header_timeout_s"):
        Limits(header_timeout_s=0)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_half_sent_heads_are_closed_after_the_header_timeout():
    """Finding: half-sent connections were held forever (500 of 500 open after 45 s)."""
    limits = Limits(header_timeout_s=0.5)
    server = ThreadedServer.start(echo_app(limits), bind("127.0.0.1", 0), limits=limits)
    host, port = server.url.rsplit("//", 1)[1].split(":")
    try:
        silent = socket.create_connection((host, int(port)))
        half = socket.create_connection((host, int(port)))
        half.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert _closed_within(silent, 5.0) and _closed_within(half, 5.0)
        # a keep-alive connection that starts a second request and stalls is closed too
        kept = socket.create_connection((host, int(port)))
        kept.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
        kept.settimeout(5.0)
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        kept.sendall(b"POST /echo HTTP/1.1\r\nHo")
        assert _closed_within(kept, 5.0)
        # an honest client is unaffected
        ok = socket.create_connection((host, int(port)))
        ok.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        ok.settimeout(5.0)
        reply = b""
        while b'{"bytes":3}' not in reply:
            chunk = ok.recv(65536)
            assert chunk, reply
            reply += chunk
        for s in (silent, half, kept, ok):
            s.close()
    finally:
        server.stop()


def test_an_answer_before_the_body_closes_the_connection():
    """Found by the chaos soak (bench/chaos.py): a client that declares a body, sends part of
    it and then trickles bytes held its connection after an early answer (a 401 before the
    body), since the server waits to drain the declared body before the next request. An
    answer given before the body is complete now says `Connection: close` and closes."""
    limits = Limits()
    server = ThreadedServer.start(echo_app(limits), bind("127.0.0.1", 0), limits=limits)
    host, port = server.url.rsplit("//", 1)[1].split(":")
    try:
        slow = socket.create_connection((host, int(port)))
        slow.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        slow.settimeout(5.0)
        reply = slow.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" in reply.lower()
        assert _closed_within(slow, 5.0)
        # a body the app read whole keeps its connection (keep-alive is unaffected)
        whole = socket.create_connection((host, int(port)))
        whole.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
        whole.settimeout(5.0)
        assert b"connection: close" not in whole.recv(65536).lower()
        for s in (slow, whole):
            s.close()
    finally:
        server.stop()


def _connect_from(source: str, port: int) -> socket.socket:
    """A connection to 127.0.0.1:port from `source`, another loopback address (127.0.0.0/8)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10.0, source_address=(source, 0))


def _echo(sock: socket.socket) -> bytes:
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    sock.settimeout(10.0)
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    return reply


def test_one_address_holds_at_most_its_share_of_the_connections():
    """Regression: every server allowed 512 connections with no share per address; one client
    re-opening half-sent heads held every slot and honest calls got 503 in 40 of 40. Now one
    address holds at most a quarter of them (8 of 32 here): its connections beyond that are
    answered 503 and closed as they open, and a client from another address is served."""
    import select

    limits = Limits(max_connections=32, header_timeout_s=60.0)  # a share of 32 / 4 = 8
    server = ThreadedServer.start(echo_app(limits), bind("127.0.0.1", 0), limits=limits)
    port = int(server.url.rsplit(":", 1)[1])
    attack: list[socket.socket] = []
    try:
        for _ in range(40):  # more half-sent heads than the server has slots
            s = _connect_from("127.0.0.2", port)
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le")
            attack.append(s)
        honest = _connect_from("127.0.0.1", port)
        reply = _echo(honest)
        assert reply.startswith(b"HTTP/1.1 200") and b'{"bytes":3}' in reply, reply
        refused: set[socket.socket] = set()
        deadline = time.monotonic() + 30.0
        while len(refused) < 32 and time.monotonic() < deadline:
            ready, _, _ = select.select([s for s in attack if s not in refused], [], [], 1.0)
            for s in ready:
                try:
                    data = s.recv(65536)
                except ConnectionResetError:
                    data = b""
                assert not data or data.startswith(b"HTTP/1.1 503"), data
                refused.add(s)
        assert len(refused) == 32, "every connection beyond the address's 8 was refused"
        held = [s for s in attack if s not in refused]
        assert not select.select(held, [], [], 0)[0], "the 8 within the share are still open"
        for s in held:
            s.close()
        # the share comes back as its connections close
        deadline = time.monotonic() + 30.0
        while True:
            again = _connect_from("127.0.0.2", port)
            reply = _echo(again)
            again.close()
            if reply.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        honest.close()
    finally:
        for s in attack:
            s.close()
        server.stop()


class _Transport:
    """What uvicorn's protocol reads and writes of an asyncio transport, from one peer."""

    def __init__(self, address: str, port: int) -> None:
        self.peer = (address, port)
        self.written = b""
        self.closed = False
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peer, "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def is_closing(self) -> bool:
        return self.closed


def test_a_connection_refused_over_its_share_takes_no_slot_of_the_server():
    """Found by bench/live_attacks.py (halfopen): one address re-opening half-sent heads as fast
    as it could made clients of other addresses get uvicorn's 503 "Exceeded concurrency limit".
    A connection refused over its address's share still counted among the server's connections
    (uvicorn's limit_concurrency: `max_connections`) until its close completed, and one accept
    batch holds hundreds of them. Now it is refused before uvicorn counts it: however many
    are refused at once, the server's connections are the ones it serves."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from blocktrain.listener import _protocol

    limits = Limits(max_connections=8, tarpit_s=0)  # a share of 2 per address, 503 at once
    protocol = _protocol(limits)
    config = uvicorn.Config(echo_app(limits), http=protocol, limit_concurrency=8)
    config.load()
    state = ServerState()
    loop = asyncio.new_event_loop()
    try:

        def connect(address: str, port: int) -> tuple[Any, _Transport]:
            conn, transport = protocol(config, state, {}, _loop=loop), _Transport(address, port)
            conn.connection_made(transport)  # type: ignore[arg-type]
            return conn, transport

        attack = [connect("127.0.0.2", 1000 + i) for i in range(50)]  # one accept batch
        refused = [(c, t) for c, t in attack if t.written.startswith(b"HTTP/1.1 503")]
        assert len(refused) == 48 and all(t.closed for _, t in refused)
        assert len(state.connections) == 2, (
            f"{len(state.connections)} connections count against the limit of 8; 2 are served"
        )
        honest, transport = connect("127.0.0.1", 2000)
        assert honest in state.connections and not transport.written
        for conn, _ in refused:  # their close completes
            conn.connection_lost(None)
        assert len(state.connections) == 3
        attack[0][0].connection_lost(None)  # one of the two served closes: the share comes back
        again, transport = connect("127.0.0.2", 3000)
        assert again in state.connections and not transport.written
    finally:
        loop.close()


def test_a_connection_over_its_share_waits_its_tarpit_unread_before_its_503():
    """Found by bench/live_attacks.py (halfopen): refused at once, a client re-opening each
    refused connection at once churned 12,000 connections a second through the server's accept
    loop (a core; honest calls took 54x their unloaded time). Now each refused connection is
    held, unread, for `tarpit_s` before its 503, up to `held_refusals` of them at once (twice
    max_connections here); beyond that the 503 goes at once. A client that leaves during its
    tarpit is forgotten."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from blocktrain.listener import _protocol, held_refusals

    limits = Limits(max_connections=8, tarpit_s=0.05)  # 2 per address; 16 held at most
    assert held_refusals(limits) == 16
    protocol = _protocol(limits)
    config = uvicorn.Config(echo_app(limits), http=protocol, limit_concurrency=8)
    config.load()
    state = ServerState()
    loop = asyncio.new_event_loop()
    try:
        attack = []
        for i in range(30):
            conn, transport = protocol(config, state, {}, _loop=loop), _Transport("127.0.0.2", i)
            conn.connection_made(transport)  # type: ignore[arg-type]
            attack.append((conn, transport))
        refused = attack[2:]
        held = [(c, t) for c, t in refused if not t.closed]
        assert len(held) == 16 and not any(t.written or t.reading for _, t in held)
        assert all(t.written.startswith(b"HTTP/1.1 503") for _, t in refused[16:])
        left = held.pop()  # its client goes away during the tarpit
        left[1].closed = True
        left[0].connection_lost(None)
        loop.run_until_complete(asyncio.sleep(0.2))
        assert all(t.written.startswith(b"HTTP/1.1 503") and t.closed for _, t in held)
        assert not left[1].written
        assert len(state.connections) == 2  # the two within the share, served
    finally:
        loop.close()


def test_a_429_is_held_for_the_tarpit_then_closes_the_connection():
    """Found by bench/live_attacks.py (stop_strings, push_flood): a client past its rate got
    its 429 at once, and 4 connections sending as fast as they were answered drew 1,800
    refusals a second from the router (a core). Now the guard sends a 429 `tarpit_s` after the
    app decided it, at most its Retry-After, with `Connection: close`."""
    app = echo_app(Limits(tarpit_s=0.3))
    started = time.monotonic()
    answer = asgi_request(app, "POST", "/limited", {"content-length": "0"})
    waited = time.monotonic() - started
    assert answer.status == 429 and answer.headers["connection"] == "close"
    assert 0.3 <= waited < 2.0, waited
    started = time.monotonic()
    asgi_request(app, "POST", "/limited", {"content-length": "0", "x-retry-after": "0"})
    assert time.monotonic() - started < 0.25, "never longer than the Retry-After"
    ok = asgi_request(app, "POST", "/echo", {"content-length": "2"}, [b"ab"])
    assert ok.status == 200 and "connection" not in ok.headers


def test_the_share_per_address_is_a_quarter_unless_set():
    assert Limits().per_address == 128 and Limits(max_connections=32).per_address == 8
    assert Limits(max_connections_per_address=600).per_address == 600
    with pytest.raises(ConfigError, match="max_connections_per_address"):
        Limits(max_connections_per_address=0)


def test_the_token_bucket_admits_a_burst_then_the_rate():
    now = [10.0]
    bucket = TokenBucket(2.0, 3, lambda: now[0], max_keys=2)
    assert [bucket.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take("a") == pytest.approx(0.5), "the wait until one request refills"
    assert bucket.take("a") == pytest.approx(0.5), "a refusal takes nothing"
    assert bucket.take("b") == 0.0, "per key"
    now[0] += 0.5
    assert bucket.take("a") == 0.0 and bucket.take("a") > 0
    now[0] -= 5.0  # a clock that steps back refills nothing, and breaks nothing
    assert bucket.take("a") > 0
    now[0] += 100.0
    assert bucket.take("c") == 0.0 and bucket.take("d") == 0.0
    assert set(bucket._buckets) == {"c", "d"}, "a's full bucket was forgotten to make room"
    for rate, burst in ((0.0, 1), (float("inf"), 1), (float("nan"), 1), (1.0, 0)):
        with pytest.raises(ConfigError, match="must be positive"):
            TokenBucket(rate, burst)


# ---------------------------------------------------------------------------------------------
# Caps per prefix and the anonymous pool (issue 58: 4 addresses x 130 half-open connections)
# ---------------------------------------------------------------------------------------------


class _Peer(_Transport):
    """A transport uvicorn can serve a request on (reads resume after each response)."""

    def resume_reading(self) -> None:
        self.reading = True


async def _marking_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers 200; a request with an Authorization header is marked a token holder's."""
    if scope["type"] != "http":
        return
    if any(k == b"authorization" for k, _ in scope["headers"]):
        mark_authenticated(scope)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


class _Server:
    """One server's protocol instances on a private event loop, connected by hand."""

    def __init__(self, limits: Limits) -> None:
        import asyncio

        import uvicorn
        from uvicorn.server import ServerState

        from blocktrain.listener import _protocol

        self.protocol = _protocol(limits)
        self.config = uvicorn.Config(
            _marking_app, http=self.protocol, limit_concurrency=limits.max_connections
        )
        self.config.load()
        self.state = ServerState()
        self.loop = asyncio.new_event_loop()
        self.ports = iter(range(1000, 100_000))

    def connect(self, address: str) -> tuple[Any, _Peer]:
        conn, peer = (
            self.protocol(self.config, self.state, {}, _loop=self.loop),
            _Peer(address, next(self.ports)),
        )
        conn.connection_made(peer)  # type: ignore[arg-type]
        return conn, peer

    def request(self, conn: Any, peer: _Peer, token: bool = False) -> bytes:
        """One GET on the connection, run to its response -> what the server wrote."""
        import asyncio

        peer.written = b""
        auth = b"Authorization: Bearer t\r\n" if token else b""
        conn.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        self.loop.run_until_complete(asyncio.sleep(0.05))
        return peer.written

    def close(self) -> None:
        self.loop.close()


def test_prefix_of_groups_a_slash_24_and_a_slash_64():
    assert prefix_of("203.0.113.7") == prefix_of("203.0.113.250") == "203.0.113.0/24"
    assert prefix_of("203.0.114.7") != prefix_of("203.0.113.7")
    assert prefix_of("2001:db8::1") == prefix_of("2001:db8::ffff:1") == "2001:db8::/64"
    assert prefix_of("2001:db8:0:1::1") != prefix_of("2001:db8::1")
    assert prefix_of("::ffff:203.0.113.7") == "203.0.113.0/24", "a mapped IPv4 is its IPv4"
    assert prefix_of("testclient") == "testclient"
    assert Limits().per_prefix == 256 and Limits().anonymous == 256
    assert Limits(max_connections_per_address=600).per_prefix == 600, "at least one address's"
    with pytest.raises(ConfigError, match="max_anonymous_connections"):
        Limits(max_anonymous_connections=0)


def test_one_slash_64_holds_at_most_its_prefix_share_however_many_addresses():
    """Issue 58: the cap counted exact addresses only, and on IPv6 one /64 holds any number of
    them. Now a prefix holds at most its share (8 of 16 here) whatever its addresses; another
    /64 is still served."""
    s = _Server(Limits(max_connections=16, max_anonymous_connections=16, tarpit_s=0))
    try:
        flood = [s.connect(f"2001:db8::{i + 1:x}") for i in range(20)]  # one each: 20 addresses
        served = [p for _, p in flood if not p.written]
        assert len(served) == 8, f"{len(served)} served of one /64; its share is 8"
        assert all(p.written.startswith(b"HTTP/1.1 503") for _, p in flood[8:])
        other, peer = s.connect("2001:db8:0:1::1")
        assert s.request(other, peer).startswith(b"HTTP/1.1 200")
    finally:
        s.close()


@pytest.mark.parametrize("caps", [True, False])
def test_half_sent_heads_from_four_addresses_leave_room_for_a_newcomer(caps: bool):
    """Issue 58: four addresses of 128 half-sent heads each (under the share of 128 per
    address) held all 512 slots, and honest calls got 503 in 40 of 40. Scaled to 64 slots
    (16 per address): four addresses of one /24 re-opening 20 each, and an honest client from
    that /24 (as 127.0.0.2-5 against 127.0.0.1). With the caps per prefix and on the anonymous
    pool the flood holds half of the slots and the newcomer displaces one of it; without them
    (both set to every slot: the old behaviour) the honest call gets 503."""
    loose = {} if caps else {"max_connections_per_prefix": 64, "max_anonymous_connections": 64}
    s = _Server(Limits(max_connections=64, tarpit_s=0, **loose))
    try:
        flood = [s.connect(f"10.0.0.{2 + i % 4}") for i in range(80)]
        open_ = [c for c, p in flood if not p.closed]
        assert len(open_) == (32 if caps else 64), len(open_)
        honest, peer = s.connect("10.0.0.1")
        answer = s.request(honest, peer)
        if caps:
            assert answer.startswith(b"HTTP/1.1 200"), answer
            assert sum(not p.closed for _, p in flood) == 31, "one flood connection made room"
        else:
            assert answer.startswith(b"HTTP/1.1 503"), "every slot was the flood's"
    finally:
        s.close()


@pytest.mark.parametrize("token", [True, False])
def test_a_token_holders_idle_connection_leaves_the_anonymous_pool(token: bool):
    """A connection whose request showed a valid token (the app marks it) waits for its next
    request outside the anonymous pool: a flood of half-sent heads cannot displace it. One
    that showed none is anonymous again between requests, and the longest waiting of the
    heaviest holder goes first."""
    s = _Server(Limits(max_connections=8, max_anonymous_connections=2, tarpit_s=0))
    try:
        holder = [s.connect("10.0.0.1") for _ in range(2)]
        for conn, peer in holder:
            assert s.request(conn, peer, token=token).startswith(b"HTTP/1.1 200")
        flood = [s.connect("10.0.1.1") for _ in range(2)]
        assert [p.closed for _, p in holder] == ([False, False] if token else [True, False])
        if token:
            assert not any(p.closed for _, p in flood), "the pool had room for the flood"
            conn, peer = holder[0]
            assert s.request(conn, peer, token=True).startswith(b"HTTP/1.1 200")
    finally:
        s.close()


def test_failed_token_checks_lock_out_an_address_then_its_prefix():
    """Issue 58: 906 token guesses a second from one address, unlimited. Now `burst` failures
    from an address (4x from its /24) lock every check from there out until the bucket refills,
    and the wait is what a 429's Retry-After says."""
    now = [0.0]
    guard = FailedAuth(Limits(failed_auth_burst=3, failed_auth_per_s=0.5), lambda: now[0])
    for _ in range(3):
        assert guard.wait("203.0.113.7") == 0.0
        guard.failed("203.0.113.7")
    assert guard.wait("203.0.113.7") == pytest.approx(2.0), "one check refills in 1 / 0.5 s"
    assert guard.wait("203.0.113.8") == 0.0, "a neighbour is not locked out by 3 failures"
    for i in range(9):  # the /24 takes 12 in all: 3 + 9 from its other addresses
        guard.failed(f"203.0.113.{20 + i}")
    assert guard.wait("203.0.113.99") > 0, "a prefix that guessed from many addresses waits"
    assert guard.wait("198.51.100.1") == 0.0
    now[0] += 10.0
    assert guard.wait("203.0.113.7") == 0.0 and guard.wait("203.0.113.99") == 0.0
    bucket = TokenBucket(1.0, 1, lambda: now[0])
    assert bucket.wait("a") == 0.0 and bucket.wait("a") == 0.0, "wait takes nothing"
