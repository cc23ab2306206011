"""Trust in serving, so that neither a client nor a forged message can misuse a host: block hosts
take work only from their router, never follow a URL named in a message, cap bodies however they
are sent, and answer malformed messages with a 4xx; the router caps bodies, request rates and work.

Each test names the finding it covers; each fails on the code before these fixes."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from blocktrain.errors import ConfigError
from blocktrain.httpserve import TokenBucket
from blocktrain.listener import ThreadedServer, bind
from blocktrain.serving.router.limits import WorkLimiter, check_rate, per_minute
from blocktrain.serving.shared.auth import SECRET_ENV, load_secret
from blocktrain.serving.shared.wire import CONTENT_TYPE, decode, encode
from tests.asgi import asgi_request
from tests.serving.conftest import Runs, start_cluster
from tests.serving.router.test_chain import _fingerprint, _sweep_message

SECRET = "s3cret-shared-by-router-and-hosts"
BEARER = {"authorization": f"Bearer {SECRET}"}


def asgi_post(
    app: object, path: str, chunks: Iterator[bytes], headers: dict[str, str] | None = None
) -> tuple[int, dict, int]:
    """POST to an ASGI app, the body sent chunk by chunk as a chunked upload would arrive
    (no Content-Length) -> (status, JSON answer, body bytes the app pulled)."""
    answer = asgi_request(app, "POST", path, headers, chunks, chunked=True)
    return answer.status, json.loads(answer.body), answer.bytes_pulled


def endless(chunk: int = 1024) -> Iterator[bytes]:
    while True:
        yield b"\0" * chunk


# --------------------------------------------------------------------------- no SSRF


def test_a_host_never_follows_a_url_named_in_the_message(cluster, stack):
    """Finding: a block host follows the request's `route` to any URL (SSRF), and the answer's
    body comes back to the caller. A message naming a route is refused, and the host makes no
    request to it."""
    fp = _fingerprint(cluster)
    x, z, _ = _sweep_message(stack, fp)
    header = {"model": "bt", "fingerprint": fp, "step": 0, "route": ["http://evil:9/steal"]}
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=encode({"x": x, "z": z}, header))
    assert r.status_code == 400, r.text
    assert "route" in r.json()["error"]["message"]
    assert not any("evil" in call for call in cluster.apps.calls)


def test_a_host_without_next_answers_the_state_to_its_caller(cluster, stack):
    """Finding (SSRF): the next hop comes from the host's configuration, never the request.
    A host behind a router makes no request at all: it answers the state for the next grid
    point, which the router sends on."""
    fp = _fingerprint(cluster)
    _, _, body = _sweep_message(stack, fp)
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=body)
    assert r.status_code == 200, r.text
    tensors, header = decode(r.content)
    # the state (and under route = features, the default, block 0's clean output u)
    assert set(tensors) == {"x", "z", "u"} and header["step"] == 1
    assert cluster.apps.calls == [], "the host called out"


def test_the_router_refuses_hosts_that_forward_on_their_own(runs):
    """Finding (SSRF): with hosts that forward to a --next, the router could not choose the
    next hop; it names the host instead of serving through it."""
    cluster = start_cluster(runs, next_urls=True)
    with cluster.router() as router:
        r = router.post("/v1/generate", json={"model": "bt", "prompt": "The ", "max_bytes": 2})
    assert r.status_code == 503, r.text
    assert "take no --next" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- authentication


@pytest.fixture
def secured(runs: Runs):
    return start_cluster(runs, secret=SECRET)


def test_a_host_refuses_work_without_the_secret_before_reading_the_body(secured, stack):
    """Finding: router and hosts do not authenticate each other. A call without the secret
    (or with a wrong one) is a 401 with one line, and not a byte of its body is read."""
    app = secured.apps.apps[secured.urls[0]]
    for headers in ({}, {"authorization": "Bearer wrong-secret-of-same-size!!"}):
        status, answer, pulled = asgi_post(app, "/v1/sweep", endless(), headers)
        assert status == 401
        assert "shared secret" in answer["error"]["message"]
        assert "\n" not in answer["error"]["message"]
        assert pulled == 0
    with TestClient(app) as host0:
        assert host0.get("/healthz").status_code == 200  # liveness stays open
        assert host0.get("/v1/info").status_code == 401  # the run's config and layout do not
        assert host0.get("/v1/info", headers=BEARER).status_code == 200
        release = {"model": "bt", "session": "someone-else-s"}  # no dropping others' caches
        assert host0.post("/v1/release", json=release).status_code == 401
        assert host0.post("/v1/release", json=release, headers=BEARER).status_code == 200
        _, _, body = _sweep_message(stack, _fingerprint(secured))
        assert host0.post("/v1/sweep", content=body, headers=BEARER).status_code == 200


def _still_open(socks: list[socket.socket], seconds: float) -> int:
    """How many of `socks` the server has not closed within `seconds` (all watched at once:
    a generous bound on an outcome, not a timing)."""
    import select

    open_ = set(socks)
    deadline = time.monotonic() + seconds
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], 0.5)
        for s in ready:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                open_.discard(s)
    return len(open_)


def test_a_host_closes_the_connection_once_it_refuses_an_unauthenticated_body(secured):
    """Regression: block hosts kept slow unauthenticated bodies open after answering 401 (20 of
    20 still open after 45 s), the server waiting to drain a body nobody reads. Now the 401
    says `Connection: close` and the host closes; a request without a body keeps alive."""
    server = ThreadedServer.start(secured.apps.apps[secured.urls[0]], bind("127.0.0.1", 0))
    port = int(server.url.rsplit(":", 1)[1])
    try:
        slow = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port), timeout=10.0)
            s.sendall(b"POST /v1/sweep HTTP/1.1\r\nHost: h\r\nContent-Length: 100000\r\n\r\nxx")
            slow.append(s)
        replies = [s.recv(65536) for s in slow]
        assert all(r.startswith(b"HTTP/1.1 401") for r in replies), replies
        left = _still_open(slow, 10.0)
        assert left == 0, f"{left} of 20 refused connections still open after 10 s"
        assert all(b"connection: close" in r.lower() for r in replies), replies
        get = socket.create_connection(("127.0.0.1", port), timeout=10.0)
        get.sendall(b"GET /v1/info HTTP/1.1\r\nHost: h\r\n\r\n")
        reply = get.recv(65536)
        assert reply.startswith(b"HTTP/1.1 401") and b"connection: close" not in reply.lower()
        for s in (*slow, get):
            s.close()
    finally:
        server.stop()


def test_a_router_with_the_secret_serves_and_one_without_is_refused(secured, stack):
    """Finding (authentication): the router presents the secret to every host; a router
    without it gets the hosts' refusal as a 502 naming the host."""
    request = {"model": "bt", "prompt": "The ", "max_bytes": 4, "seed": 3}
    with secured.router(secret=SECRET) as router:
        ok = router.post("/v1/generate", json=request)
    assert ok.status_code == 200, ok.text
    with secured.router() as router:
        refused = router.post("/v1/generate", json=request)
    assert refused.status_code == 502, refused.text
    assert refused.json()["error"]["host"] == secured.urls[0]
    assert "shared secret" in refused.json()["error"]["message"]


def test_a_chain_without_router_presents_the_secret_to_its_next_host(runs, stack):
    """Finding (authentication): a host forwarding along its own --next authenticates too."""
    cluster = start_cluster(runs, next_urls=True, secret=SECRET)
    _, _, body = _sweep_message(stack, _fingerprint(cluster))
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=body, headers=BEARER)
    assert r.status_code == 200, r.text
    assert "logits" in decode(r.content)[0]


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path):
    """Finding (authentication): the secret is never only on the command line."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert load_secret(str(path), {}) == SECRET
    assert load_secret(None, {SECRET_ENV: SECRET}) == SECRET
    assert load_secret(None, {}) is None
    path.write_text("short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(str(path), {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(str(tmp_path / "missing"), {})


# --------------------------------------------------------------------------- body caps


def test_a_chunked_upload_is_cut_off_at_the_hosts_body_limit(runs):
    """Finding: chunked uploads bypass the hosts' 256 MiB limit. A body without a
    Content-Length is refused with 413 once it passes the cap, without reading the rest."""
    cluster = start_cluster(runs, max_body_bytes=4096)
    status, answer, pulled = asgi_post(cluster.apps.apps[cluster.urls[0]], "/v1/sweep", endless())
    assert status == 413
    assert answer["error"]["code"] == "too_large"
    assert pulled <= 4096 + 1024


def test_the_router_caps_request_bodies(cluster):
    """Finding: the router has no body limit. A declared or chunked body over
    max_body_bytes is a 413, in the OpenAI error shape."""
    with cluster.router(max_body_bytes=1000) as router:
        r = router.post("/v1/generate", json={"model": "bt", "prompt": "a" * 2000})
        app = router.app
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "too_large"
    status, answer, pulled = asgi_post(
        app, "/v1/generate", endless(), {"content-type": "application/json"}
    )
    assert status == 413 and pulled <= 1000 + 1024
    assert answer["error"]["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- router limits


def test_the_router_caps_the_work_of_one_request(cluster):
    """Finding: one legal request (4096 bytes at steps_per_block 16) is 12 minutes of chain
    compute. Work (bytes x steps_per_block) over the router's limit is a 422 before any host
    computes."""
    with cluster.router() as router:
        r = router.post(
            "/v1/completions",
            json={"model": "bt", "prompt": "The ", "max_tokens": 4096, "steps_per_block": 16},
        )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "too_much_work"
    assert r.json()["error"]["param"] == "max_tokens"
    assert "65536 units" in r.json()["error"]["message"]
    assert cluster.apps.calls == [f"{u}/v1/info" for u in cluster.urls]
    with cluster.router(max_work=8) as router:
        small = router.post(
            "/v1/generate",
            json={"model": "bt", "prompt": "The ", "max_bytes": 4, "steps_per_block": 2},
        )
        big = router.post(
            "/v1/generate",
            json={"model": "bt", "prompt": "The ", "max_bytes": 5, "steps_per_block": 2},
        )
    assert small.status_code == 200, small.text
    assert big.status_code == 422 and big.json()["error"]["param"] == "max_bytes"


def test_the_router_caps_the_work_in_flight_and_releases_it(cluster):
    """Finding: the router has no concurrency limit. Work beyond max_work_in_flight is a
    429 with Retry-After; a finished request (plain, streamed or failed) frees its work."""
    request = {"model": "bt", "prompt": "The ", "max_tokens": 4}
    with cluster.router(max_work=8, max_work_in_flight=10) as router:
        work = router.app.state.router.work
        held = work.admit(8, "test", "max_tokens")  # another request, running
        work.admit(2, "test", "max_tokens", "10.0.0.9")  # and another client's
        busy = router.post("/v1/completions", json=request)  # past its fair share, 10 / 3
        assert busy.status_code == 429, busy.text
        assert busy.json()["error"]["code"] == "busy"
        assert busy.headers["retry-after"] == "1"
        work.release(held)
        work.release(2, "10.0.0.9")
        assert router.post("/v1/completions", json=request).status_code == 200
        with router.stream("POST", "/v1/completions", json={**request, "stream": True}) as s:
            assert s.status_code == 200
            assert work.in_flight == 4
            list(s.iter_lines())
        cluster.apps.down.add(cluster.urls[1])
        failed = router.post("/v1/completions", json=request)
        assert failed.status_code == 503
        assert work.in_flight == 0


def test_the_router_limits_requests_per_client(cluster):
    """Finding: the router has no rate limit. Past --rate-limit requests a minute a client
    gets 429 with Retry-After, before its body is parsed; the bucket refills with time."""
    now = [0.0]
    app_settings = {"rate_per_minute": 2}
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(
        RouterSettings(hosts=tuple(cluster.urls), **app_settings),  # type: ignore[arg-type]
        transport=cluster.apps,
        clock=lambda: now[0],
    )
    with TestClient(app) as router:
        codes = [router.post("/v1/generate", json={}).status_code for _ in range(3)]
        assert codes == [400, 400, 429]
        r = router.post("/v1/generate", content=b"not even json")
        assert r.status_code == 429 and r.headers["retry-after"] == "30"
        assert r.headers["connection"] == "close", "its body is never read: the server closes"
        assert r.json()["error"]["type"] == "rate_limit_error"
        now[0] += 30.0
        assert router.post("/v1/generate", json={}).status_code == 400
        assert router.get("/v1/models").status_code == 200  # reads are not counted


def test_rate_and_work_limiters_count_exactly():
    """Finding (router limits): the limiters' arithmetic, clock injected."""
    now = [0.0]
    minute = per_minute(60, lambda: now[0])
    assert (minute.rate_per_s, minute.burst) == (1.0, 60)
    rate = TokenBucket(1.0, 60, lambda: now[0], max_keys=2)  # the same, for 2 clients
    for _ in range(60):
        check_rate(rate, "a")
    with pytest.raises(Exception, match="more than 60 requests a minute"):
        check_rate(rate, "a")
    now[0] += 1.0
    check_rate(rate, "a")
    check_rate(rate, "b")
    now[0] += 120.0
    check_rate(rate, "c")  # full buckets are forgotten to make room
    assert set(rate._buckets) <= {"a", "b", "c"} and len(rate._buckets) <= 2
    work = WorkLimiter(per_request=10, in_flight_max=15)
    a = work.admit(10, "w", "max_tokens")
    with pytest.raises(Exception, match="busy"):
        work.admit(6, "w", "max_tokens")
    work.release(a)
    assert work.in_flight == 0


def _unread_stream(
    app: object,
    client: str,
    started: list[int],
    stall_s: float = 3600.0,
    received: list[bytes] | None = None,
) -> asyncio.Task:
    """A streamed completion from `client` whose reader does not read: the router's first
    send of a body chunk returns after `stall_s` (the connection's buffers are full until the
    reader reads; by default it never does), the later ones at once, into `received`; its
    status goes into `started` once the response starts."""
    body = json.dumps(
        {"model": "bt", "prompt": "The ", "max_tokens": 8, "stream": True, "seed": 1}
    ).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": (client, 1),
        "server": ("127.0.0.1", 2),
    }
    sent_body = [False]

    async def receive() -> dict:
        if not sent_body[0]:
            sent_body[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # never hangs up
        return {"type": "http.disconnect"}

    stalled = [False]

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            started.append(message["status"])
        elif message["type"] == "http.response.body" and message.get("body"):
            if not stalled[0]:
                stalled[0] = True
                await asyncio.sleep(stall_s)  # nobody reads, for now
            if received is not None:
                received.append(message["body"])

    return asyncio.ensure_future(app(scope, receive, send))  # type: ignore[operator]


async def _honest_completion(app: object) -> httpx.Response:
    """A small completion from another client (address 10.0.0.7), answered whole."""
    transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as honest:
        return await honest.post(
            "/v1/completions",
            json={"model": "bt", "prompt": "The ", "max_tokens": 8, "seed": 2},
            timeout=60,
        )


def test_unread_streams_of_one_client_leave_work_for_everyone_else(cluster):
    """Regression: the router's in-flight work budget was shared by all clients; four streams
    that are never read held all of it, and every other client got 429 (75 of 75). Now one
    client (address) holds at most half of the budget: 2 of its 4 unread streams start, the
    other 2 get 429 `busy`, and a client from another address is served."""
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(
        RouterSettings(hosts=tuple(cluster.urls), max_work=8, max_work_in_flight=32),
        transport=cluster.apps,
    )
    router = app.state.router

    async def main() -> tuple[list[int], int, str]:
        started: list[int] = []
        streams = [_unread_stream(app, "10.0.0.66", started) for _ in range(4)]
        for _ in range(600):  # until all four have an answer (a generous bound)
            if len(started) == 4:
                break
            await asyncio.sleep(0.05)
        r = await _honest_completion(app)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return started, r.status_code, r.text

    started, status, text = asyncio.run(main())
    assert status == 200, text
    assert sorted(started) == [200, 200, 429, 429], started
    assert router.work.in_flight == 0 and router.work.by_client == {}


def test_streams_nobody_reads_from_many_addresses_leave_work_for_everyone_else(cluster):
    """Regression (bench/live_attacks.py, unread_streams_4_addresses): each address's share
    of the work was bounded, but streams nobody read from four addresses held all of it, and
    every other client got 429 (30 of 30). Now a stream whose client reads nothing for
    `park_after_s` gives its work back: the four streams stay open, with no work in flight,
    and another client is served."""
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(
        RouterSettings(
            hosts=tuple(cluster.urls), max_work=8, max_work_in_flight=32, park_after_s=0.1
        ),
        transport=cluster.apps,
    )
    router = app.state.router

    async def main() -> tuple[list[int], int, int, str]:
        started: list[int] = []
        streams = [_unread_stream(app, f"10.0.0.{60 + i}", started) for i in range(4)]
        for _ in range(600):  # until all four started and parked (a generous bound)
            if len(started) == 4 and router.work.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        parked = router.work.in_flight
        r = await _honest_completion(app)
        assert not any(task.done() for task in streams), "a parked stream ended"
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return started, parked, r.status_code, r.text

    started, parked, status, text = asyncio.run(main())
    assert started == [200] * 4 and parked == 0, (started, parked)
    assert status == 200, text
    assert router.work.in_flight == 0 and router.work.by_client == {}


def test_parked_streams_still_count_in_their_clients_share(cluster):
    """A client cannot open stream after stream nobody reads, each parked in turn, and take the
    whole budget: its parked streams stay in its share (16 units: two streams of 8), so its
    next two are refused `busy` though the work in flight is empty."""
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(
        RouterSettings(
            hosts=tuple(cluster.urls), max_work=8, max_work_in_flight=32, park_after_s=0.1
        ),
        transport=cluster.apps,
    )
    router = app.state.router

    async def main() -> tuple[list[int], int, list[int]]:
        first: list[int] = []
        streams = [_unread_stream(app, "10.0.0.66", first) for _ in range(2)]
        for _ in range(600):
            if len(first) == 2 and router.work.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        parked = router.work.in_flight
        more: list[int] = []
        streams += [_unread_stream(app, "10.0.0.66", more) for _ in range(2)]
        for _ in range(600):
            if len(more) == 2:
                break
            await asyncio.sleep(0.05)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return first, parked, more

    first, parked, more = asyncio.run(main())
    assert first == [200, 200] and parked == 0, (first, parked)
    assert more == [429, 429], more
    assert router.work.in_flight == 0 and router.work.by_client == {}


def test_a_parked_stream_takes_its_work_again_and_ends_in_full_when_its_client_reads(cluster):
    """A stream parked while its client read nothing goes on once it reads: its work is
    counted in flight again, and the stream ends with every piece and [DONE]."""
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(
        RouterSettings(hosts=tuple(cluster.urls), park_after_s=0.1), transport=cluster.apps
    )
    router = app.state.router

    async def main() -> tuple[int, int, bool, bytes]:
        started: list[int] = []
        received: list[bytes] = []
        stream = _unread_stream(app, "10.0.0.66", started, stall_s=1.0, received=received)
        held = parked = -1
        for _ in range(600):
            if started and held < 0:
                held = router.work.in_flight
            if started and router.work.in_flight == 0:
                parked = 0
                break
            await asyncio.sleep(0.02)
        done, _ = await asyncio.wait([stream], timeout=60)
        if not done:
            stream.cancel()
        return held, parked, bool(done), b"".join(received)

    held, parked, ended, body = asyncio.run(main())
    assert held == 8 and parked == 0, (held, parked)
    assert ended, "the stream did not go on when its client read"
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    assert router.work.in_flight == 0 and router.work.by_client == {}


def test_a_stream_nobody_reads_ends_after_the_send_timeout_and_frees_its_work(cluster):
    """Regression: an unread stream held its work until the client hung up, which it never
    does. Now a send that waits past `send_timeout_s` ends the stream and releases its work."""
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(
        RouterSettings(hosts=tuple(cluster.urls), send_timeout_s=0.2), transport=cluster.apps
    )
    router = app.state.router

    async def main() -> tuple[list[int], int, bool]:
        started: list[int] = []
        stream = _unread_stream(app, "10.0.0.66", started)
        for _ in range(600):
            if started:
                break
            await asyncio.sleep(0.05)
        held = router.work.in_flight
        done, _ = await asyncio.wait([stream], timeout=60)  # generous: it ends after 0.2 s
        if not done:
            stream.cancel()
        return started, held, bool(done)

    started, held, ended = asyncio.run(main())
    assert started == [200] and held == 8, (started, held)
    assert ended, "the stream was still waiting for its reader"
    assert router.work.in_flight == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/generate"])
def test_a_request_whose_client_hung_up_stops_computing_and_frees_its_work(cluster, path):
    """Regression: a non-streamed request kept computing after its client disconnected, and held
    its work in flight the while (34 s). Now the router stops at the hang-up: the chain runs
    a few traversals, not the 2000 that 4000 bytes need."""
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(RouterSettings(hosts=tuple(cluster.urls)), transport=cluster.apps)
    router = app.state.router
    size = "max_tokens" if path == "/v1/completions" else "max_bytes"
    body = json.dumps({"model": "bt", "prompt": "The ", size: 4000, "seed": 1}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("10.0.0.66", 1),
        "server": ("127.0.0.1", 2),
    }
    calls_before = len(cluster.apps.calls)
    asked = [0]
    held: list[int] = []

    async def receive() -> dict:
        asked[0] += 1
        if asked[0] == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        while len(cluster.apps.calls) - calls_before < 30:  # a few traversals in: hang up
            await asyncio.sleep(0.01)
        held.append(router.work.in_flight)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    async def main() -> bool:
        task = asyncio.ensure_future(app(scope, receive, send))
        done, _ = await asyncio.wait([task], timeout=120)  # generous: a 4000-byte run is ~15 s
        if not done:
            task.cancel()
        return bool(done)

    assert asyncio.run(main()), "the request did not end"
    traversals = (len(cluster.apps.calls) - calls_before) / len(cluster.urls)
    assert traversals < 200, f"{traversals:.0f} traversals for a client that hung up after 10"
    assert held == [4000], "the work was held until the hang-up"
    assert router.work.in_flight == 0


def test_a_newcomer_within_its_fair_share_is_admitted_over_a_full_budget():
    """Found by bench/live_attacks.py (unread_streams_4_addresses): four addresses, each
    within its share (half the budget), held the whole budget with streams their buffers had
    not yet stalled, and another client got 429 on 118 of 118 tries. Now a client whose work
    stays within its fair share (the budget over the clients holding work) is admitted over a
    full budget, up to twice the budget, and while the budget is over, the clients above
    their share pause between pieces; the smallest holder never does."""
    work = WorkLimiter(per_request=8, in_flight_max=32, per_client=16)
    for client in ("a", "a", "b", "b"):
        work.admit(8, "w", "max_tokens", client)
    assert work.in_flight == 32 and not work.should_yield("a")
    work.admit(8, "w", "max_tokens", "c")  # fair share 32 / 3: admitted over the budget
    with pytest.raises(Exception, match="busy"):
        work.admit(8, "w", "max_tokens", "c")  # 16 would pass it
    assert work.should_yield("a") and work.should_yield("b") and not work.should_yield("c")
    work.admit(8, "w", "max_tokens", "d")  # 32 / 4
    honest = work.admit(4, "w", "max_tokens", "e")  # 32 / 5
    assert work.in_flight == 52
    assert [work.should_yield(x) for x in "abcde"] == [True, True, True, True, False]
    for i in range(3):  # newcomers: the work in flight stays within twice the budget
        work.admit(4, "w", "max_tokens", f"f{i}")
    with pytest.raises(Exception, match="busy"):
        work.admit(4, "w", "max_tokens", "g")
    assert work.in_flight == 64
    equal = WorkLimiter(per_request=8, in_flight_max=8)  # the smallest holder goes on
    equal.admit(5, "w", "max_tokens", "x")
    equal.admit(4, "w", "max_tokens", "y")  # 4 <= 8 / 2: over the budget, at 9
    assert equal.in_flight == 9 and equal.should_yield("x") and not equal.should_yield("y")
    work.release(honest, "e")


def test_a_client_is_served_while_four_addresses_hold_the_budget_with_live_streams(cluster):
    """The same through the router: two streams from each of four addresses, none yet
    stalled long enough to park, and a fifth client's completion is answered, not 429."""
    from blocktrain.serving import RouterSettings, create_router_app

    app = create_router_app(
        RouterSettings(
            hosts=tuple(cluster.urls), max_work=8, max_work_in_flight=32, park_after_s=3600
        ),
        transport=cluster.apps,
    )
    router = app.state.router

    async def main() -> tuple[list[int], int, str]:
        started: list[int] = []
        streams = []
        for i in range(4):
            for _ in range(2):
                streams.append(_unread_stream(app, f"10.0.0.{60 + i}", started))
                for _ in range(600):
                    if len(started) == len(streams):
                        break
                    await asyncio.sleep(0.01)
        transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as honest:
            r = await honest.post(
                "/v1/completions",
                json={"model": "bt", "prompt": "The ", "max_tokens": 4, "seed": 2},
                timeout=60,
            )
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        return started, r.status_code, r.text

    started, status, text = asyncio.run(main())
    assert started == [200] * 4 + [200, 429] * 2, started
    assert status == 200, text
    assert router.work.in_flight == 0 and router.work.by_client == {}


def test_the_work_share_per_client_counts_exactly():
    work = WorkLimiter(per_request=10, in_flight_max=30, per_client=15)
    a = work.admit(10, "w", "max_tokens", "a")
    with pytest.raises(Exception, match="its share of 15"):
        work.admit(6, "w", "max_tokens", "a")
    b = work.admit(10, "w", "max_tokens", "b")  # another client is admitted
    work.admit(5, "w", "max_tokens", "a")
    work.release(a, "a")
    work.release(5, "a")
    work.release(b, "b")
    assert work.in_flight == 0 and work.by_client == {}


# --------------------------------------------------------------------------- malformed messages


def _raw(header: object, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            save({"x": torch.zeros(1, 3, dtype=torch.uint8)}, metadata={"blocktrain": NESTED}),
            id="deeply-nested-header",
        ),
        pytest.param(
            save(
                {"x": torch.zeros(1, 3, dtype=torch.uint8)},
                metadata={"blocktrain": '{"model": ' + NESTED + "}"},
            ),
            id="deeply-nested-field",
        ),
        pytest.param(_raw({"__metadata__": {"blocktrain": 5}}), id="non-string-metadata"),
        pytest.param(_raw({"__metadata__": {"blocktrain": {"a": 1}}}), id="object-metadata"),
        pytest.param(
            _raw({"x": {"dtype": "U8", "shape": [2**62, 2**62], "data_offsets": [0, 0]}}),
            id="huge-declared-shape",
        ),
        pytest.param(struct.pack("<Q", 2**63) + b"{}", id="huge-declared-header"),
        pytest.param(
            _raw({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
            id="wrong-dtype",
        ),
        pytest.param(
            encode({"x": torch.zeros(1, 1, 1, dtype=torch.uint8)}, {"model": "bt"}),
            id="wrong-shape",
        ),
    ],
)
def test_malformed_host_messages_are_4xx(cluster, body):
    """Finding: malformed host messages give 500 (deeply nested JSON, non-string metadata).
    Every one is a 400 that says why. The nested headers were the 500s at the hosts; the
    other cases (refused by safetensors' parser or the host's checks) keep them 400."""
    with TestClient(cluster.apps.apps[cluster.urls[0]], raise_server_exceptions=False) as h:
        for path in ("/v1/sweep", "/v1/stage", "/v1/release"):
            r = h.post(path, content=body, headers={"content-type": CONTENT_TYPE})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"]


def test_an_absurd_content_length_is_a_400_at_host_and_router(cluster):
    """Finding (malformed messages): a Content-Length no server could honour is a 400."""
    headers = {"content-length": "99999999999999999999"}
    with TestClient(cluster.apps.apps[cluster.urls[0]], raise_server_exceptions=False) as h:
        assert h.post("/v1/sweep", content=b"x", headers=headers).status_code == 400
    with cluster.router() as router:
        r = router.post("/v1/generate", content=b"x", headers=headers)
    assert r.status_code == 400 and "error" in r.json()


def test_a_router_body_it_cannot_parse_is_an_openai_shaped_400(router):
    """Finding (malformed messages): deeply nested JSON to the router is a 400 in the error
    shape every other router error has (it was FastAPI's bare {"detail": ...})."""
    r = router.post(
        "/v1/completions",
        content='{"model": "bt", "prompt": ' + NESTED + "}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_host_answering_nested_json_is_a_gateway_error_not_a_500(cluster):
    """Finding (malformed messages): deeply nested JSON from a host (an error body, a trace
    header, its /v1/info) made the router, or the host before it, fail with a 500."""
    real = cluster.apps.apps[cluster.urls[2]]
    nested = NESTED.encode()

    async def broken(scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/v1/info":
            await real(scope, receive, send)
            return
        headers = [(b"content-type", b"application/json"), (b"x-blocktrain-trace", nested)]
        await send({"type": "http.response.start", "status": 409, "headers": headers})
        await send({"type": "http.response.body", "body": nested})

    cluster.apps.apps[cluster.urls[2]] = broken
    request = {"model": "bt", "prompt": "The ", "max_bytes": 2}
    with cluster.router() as router:
        r = router.post("/v1/generate", json=request)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["host"] == cluster.urls[2]

        async def nested_info(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": nested})

        cluster.apps.apps[cluster.urls[2]] = nested_info
        r = router.post("/v1/generate", json=request)
        assert r.status_code == 502, r.text
        assert "bad /v1/info" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- client tokens


def test_one_token_holds_one_share_from_however_many_addresses():
    """Issue 58: two addresses could hold the router's whole in-flight budget, the share being
    per address only. With tokens a request counts against its token and its address: one
    token from two addresses holds one share (16 of 32), an address at most a share whatever
    tokens it shows, and another token still gets its floor over a full budget (the budget
    over the tokens holding work) while those above their share yield to it."""
    work = WorkLimiter(per_request=8, in_flight_max=32, per_client=16)
    work.admit(8, "w", "max_tokens", "token a", "10.0.0.1")
    work.admit(8, "w", "max_tokens", "token a", "10.0.0.2")
    with pytest.raises(Exception, match=r"busy for token a: 16 units"):
        work.admit(8, "w", "max_tokens", "token a", "10.0.0.3")  # a third address: no more
    work.admit(8, "w", "max_tokens", "token b", "10.0.0.1")
    with pytest.raises(Exception, match=r"busy for 10\.0\.0\.1: 16 units"):
        work.admit(8, "w", "max_tokens", "token c", "10.0.0.1")
    work.admit(8, "w", "max_tokens", "token c", "10.0.0.4")  # the budget is full: 32
    floor = work.admit(8, "w", "max_tokens", "token d", "10.0.0.6")  # 8 <= 32 / 4 tokens
    assert work.in_flight == 40
    assert work.should_yield("token a") and not work.should_yield("token d")
    work.release(floor, "token d", address="10.0.0.6")
    for client, address in (("token a", "10.0.0.1"), ("token a", "10.0.0.2")):
        work.release(8, client, address=address)
    work.release(8, "token b", address="10.0.0.1")
    work.release(8, "token c", address="10.0.0.4")
    assert work.in_flight == 0 and work.by_client == {} and work.by_address == {}


TOKEN = "client-token-of-at-least-16"


def _router_with_tokens(cluster, tmp_path):
    from blocktrain.serving import RouterSettings, create_router_app
    from blocktrain.serving.router.client_tokens import load_tokens

    path = tmp_path / "tokens"
    path.write_text(f"# the clients\n{TOKEN}\n\nanother-token-0123456789\n")
    tokens = load_tokens(str(path))
    assert len(tokens) == 2, "comments and blank lines are skipped"
    settings = RouterSettings(hosts=tuple(cluster.urls), tokens=tokens)
    return create_router_app(settings, transport=cluster.apps)


def test_a_router_with_tokens_serves_their_holders_and_counts_work_per_token(cluster, tmp_path):
    """`serve --set tokens_file=PATH`: a /v1/ request without a token or with a wrong one gets one 401
    (`invalid_api_key`, the same message for both); a token's is served, its work counted
    against its token and its address, and its connection marked a token holder's (the
    listener's anonymous pool); /healthz stays open."""
    from blocktrain.httpserve import AUTHENTICATED, FailedAuth, Limits
    from blocktrain.serving.router.client_tokens import RequireToken
    from blocktrain.serving.router.limits import CLIENT_TOKEN

    app = _router_with_tokens(cluster, tmp_path)
    router = app.state.router
    admitted: list[tuple] = []
    admit = router.work.admit

    def spy(*args: object) -> int:
        admitted.append(args)
        return admit(*args)

    router.work.admit = spy
    body = {"model": "bt", "prompt": "The ", "max_tokens": 4, "seed": 1}
    with TestClient(app) as client:
        none = client.post("/v1/completions", json=body)
        wrong = client.post("/v1/completions", json=body, headers={"authorization": "Bearer x"})
        assert none.status_code == wrong.status_code == 401
        assert none.json() == wrong.json() and none.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/healthz").status_code == 200
        assert admitted == [], "no work admitted without a token"
        headers = {"authorization": f"Bearer {TOKEN}"}
        ok = client.post("/v1/completions", json=body, headers=headers)
        assert ok.status_code == 200, ok.text
    ((*_, client_key, address),) = admitted
    assert client_key.startswith("token ") and address == "testclient"
    # what the token check leaves in the scope: the token, and the mark the listener reads
    state: dict = {}

    async def inner(scope: dict, receive: object, send: object) -> None:
        state.update(scope["state"])

    check = RequireToken(inner, router.settings.tokens, FailedAuth(Limits()))
    scope = {"type": "http", "path": "/v1/models", "client": ("10.0.0.1", 1)}
    asyncio.run(
        check(
            {**scope, "headers": [(b"authorization", headers["authorization"].encode())]},
            None,
            None,
        )
    )  # type: ignore[arg-type]
    assert state[AUTHENTICATED] and state[CLIENT_TOKEN] == client_key.removeprefix("token ")
    assert router.work.in_flight == 0 and router.work.by_address == {}


def test_a_router_locks_out_an_address_that_guesses_tokens(cluster, tmp_path):
    """Issue 58, at the router: failed token checks from one address past a burst get 429
    with a Retry-After, a valid token's too; another address is served."""
    app = _router_with_tokens(cluster, tmp_path)
    # no `with`: the app's lifespan (which closes its client to the hosts) never runs
    guesser = TestClient(app, client=("203.0.113.7", 1))
    for i in range(20):  # Limits.failed_auth_burst
        r = guesser.get("/v1/models", headers={"authorization": f"Bearer guess-{i:020d}"})
        assert r.status_code == 401
    for token in ("guess-again-0000000000", TOKEN):
        r = guesser.get("/v1/models", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 429 and "failed token checks" in r.text, r.text
        assert int(r.headers["retry-after"]) >= 1
    other = TestClient(app, client=("198.51.100.1", 1))
    r = other.get("/v1/models", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
