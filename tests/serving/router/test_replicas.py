"""Block replicas in the router: the `URL|URL` syntax, health scores, failover of a stream whose
replica dies mid-stream, a clear 503 naming the block when no replica is left, and /readyz."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from blocktrain.errors import ConfigError
from blocktrain.model import Sampling, utf8
from blocktrain.serving import HostSettings, ModelSource, RouterSettings, create_host_app
from blocktrain.serving.router.directory import Directory
from blocktrain.serving.router.replicas import Health
from blocktrain.serving.shared.transport import make_client
from tests.serving.conftest import URLS, Apps, Cluster, Runs, in_process

REPLICA = "http://host1b:8112"
"""A second host of block 1."""


def replica_cluster(runs: Runs, replica_parts: tuple[int, ...] = (1,)) -> Cluster:
    """host0: block 0, host1 and host1b: block 1, host2: block 2 (and the reference's stages)."""
    apps = Apps()
    for url, parts in [*zip(URLS, [(0,), (1,), (2,)], strict=True), (REPLICA, replica_parts)]:
        settings = HostSettings(
            models=(ModelSource("bt", runs.blocktrain), ModelSource("ref", runs.reference)),
            parts=parts,
            public_url=url,
        )
        apps.apps[url] = create_host_app(settings, transport=apps)
    hosts = [URLS[0], f"{URLS[1]}|{REPLICA}", URLS[2]]
    return Cluster(apps, hosts, runs)


def events_of(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


def test_hosts_take_replicas_per_position_and_refuse_bad_ones():
    settings = RouterSettings(hosts=("http://a:1", "http://b:2|http://c:3"))
    assert settings.positions == (("http://a:1",), ("http://b:2", "http://c:3"))
    with pytest.raises(ConfigError, match="twice"):
        RouterSettings(hosts=("http://a:1", "http://b:2|http://a:1"))
    with pytest.raises(ConfigError, match="empty position"):
        RouterSettings(hosts=("http://a:1", "|"))
    with pytest.raises(ConfigError, match="not an http"):
        RouterSettings(hosts=("http://a:1|ftp://b",))


def test_health_puts_a_failed_replica_last_until_its_cooldown_passes():
    now = [0.0]
    health = Health(lambda: now[0], cooldown_s=30)
    for url, seconds in (("a", 0.5), ("b", 0.1)):
        health.started(url)
        health.succeeded(url, seconds)
    assert health.order(("a", "b")) == ["b", "a"], "the faster replica first"
    health.started("b")
    health.started("b")
    health.started("b")
    health.started("b")
    health.started("b")
    assert health.order(("a", "b")) == ["a", "b"], "five in flight on b outweigh its speed"
    for _ in range(5):
        health.succeeded("b", 0.1)
    health.started("b")
    health.failed("b", "connection refused")
    assert health.order(("a", "b")) == ["a", "b"]
    assert health.describe("b")["healthy"] is False
    assert health.describe("b")["last_error"] == "connection refused"
    now[0] = 31.0
    assert health.order(("a", "b")) == ["b", "a"], "the cooldown is over"


def test_models_list_the_replicas_of_each_position(runs):
    cluster = replica_cluster(runs)
    with cluster.router() as router:
        bt = {m["id"]: m for m in router.get("/v1/models").json()["data"]}["bt"]
        assert bt["hosts"] == cluster.urls


@pytest.mark.parametrize("how", ["down", "dies"])
def test_a_replica_killed_mid_stream_hands_over_and_the_stream_completes(runs, stack, how):
    cluster = replica_cluster(runs)
    served: list[str] = []

    def kill_after_two_spans(url: str, request) -> None:
        if url in (URLS[1], REPLICA) and request.url.path == "/v1/sweep":
            served.append(url)
            if len(served) == 3:  # the replica serving this stream dies on its third span
                getattr(cluster.apps, how).add(url)  # refuses it, or computes and hangs up

    cluster.apps.before = kill_after_two_spans
    request = {"model": "bt", "prompt": "The ", "max_tokens": 12, "seed": 5, "stream": True}
    with cluster.router() as router:
        r = router.post("/v1/completions", json=request)
    assert r.status_code == 200, r.text
    events = events_of(r.text)
    assert events[-1] == "data: [DONE]", events[-1]
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    drawn = bytes(in_process(stack, b"The ", 12, 5, Sampling(utf8=True)))  # the OpenAI default
    expected = drawn[: utf8.complete_length(drawn)].decode("utf-8")
    assert text == expected, "the other replica computed what the dead one would have"
    first = served[0]
    other = REPLICA if first == URLS[1] else URLS[1]
    assert served[:3] == [first] * 3, "a stream stays on its replica while it lives"
    assert set(served[3:]) == {other}, "after the death, every span went to the other replica"
    assert len(served) == 6 + 1, "6 spans, one of them sent twice"


@pytest.mark.parametrize("model", ["bt", "ref"])
def test_with_no_replica_left_the_request_fails_with_503_naming_the_block(runs, model):
    cluster = replica_cluster(runs)
    with cluster.router() as router:
        assert router.post("/v1/generate", json={"model": model, "prompt": "ab"}).status_code == 200
        cluster.apps.dies.update({URLS[1], REPLICA})
        r = router.post("/v1/generate", json={"model": model, "prompt": "ab", "max_bytes": 4})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    what = "block(s) [1]" if model == "bt" else "stage(s) [1]"
    assert f"no replica of {what} of {model!r} is left" in err["message"], err
    assert URLS[1] in err["message"] and REPLICA in err["message"]
    assert err["code"] == "no_replica"


def test_a_stream_whose_last_replica_dies_ends_with_an_error_event_naming_the_block(runs):
    cluster = replica_cluster(runs)
    sweeps = {"n": 0}

    def kill_both(url: str, request) -> None:
        if url in (URLS[1], REPLICA) and request.url.path == "/v1/sweep":
            sweeps["n"] += 1
            if sweeps["n"] == 2:
                cluster.apps.down.update({URLS[1], REPLICA})

    cluster.apps.before = kill_both
    # utf8 off: the first sweep's byte is sent at once, so the stream has begun when the
    # replicas die (a held lead byte would leave nothing sent, and a plain 503 answers instead)
    request = {"model": "bt", "prompt": "The ", "max_tokens": 8, "stream": True, "utf8": False}
    with cluster.router() as router:
        r = router.post("/v1/completions", json=request)
    last = json.loads(events_of(r.text)[-1][6:])
    assert "no replica of block(s) [1] of 'bt' is left" in last["error"]["message"], last


def test_a_replica_that_serves_other_blocks_is_left_out(runs):
    cluster = replica_cluster(runs, replica_parts=(2,))
    with cluster.router() as router:
        r = router.post("/v1/generate", json={"model": "bt", "prompt": "ab"})
        assert r.status_code == 200, r.text
        ready = router.get("/readyz").json()
    assert "serves other blocks or runs" in ready["down"][REPLICA]


def test_readyz_sweeps_every_replica_and_names_the_one_that_fails(runs):
    cluster = replica_cluster(runs)
    with cluster.router() as router:
        assert router.get("/healthz").status_code == 200
        r = router.get("/readyz")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ready"] is True and body["down"] == {}
        every = {URLS[0], URLS[1], REPLICA, URLS[2]}
        assert set(body["models"]["bt"]) == every and set(body["models"]["ref"]) == every
        assert set(body["models"]["bt"].values()) == {"ok"}
        sweeps = [c for c in cluster.apps.calls if c.endswith("/v1/sweep")]
        assert {c.removesuffix("/v1/sweep") for c in sweeps} == every

        # A replica that answers /v1/info but dies when it computes: still ready (the other
        # replica serves), and the report names it.
        failing = {REPLICA}

        def compute_fails(url: str, request: httpx.Request) -> None:
            if url in failing and request.url.path != "/v1/info":
                raise httpx.RemoteProtocolError("Server disconnected", request=request)

        cluster.apps.before = compute_fails
        body = router.get("/readyz").json()
        assert body["ready"] is True
        assert "Server disconnected" in body["models"]["bt"][REPLICA]
        assert body["hosts"][REPLICA]["healthy"] is False

        # No replica of block 1 computes: not ready, naming the block and the hosts.
        failing.add(URLS[1])
        r = router.get("/readyz")
        assert r.status_code == 503
        err = r.json()["error"]
        assert "block(s) [1]" in err["message"] and URLS[1] in err["message"], err
        assert router.get("/healthz").status_code == 200, "liveness stays cheap and up"

        # A host that is down entirely: 503 naming it.
        failing.clear()
        cluster.apps.down.add(URLS[2])
        r = router.get("/readyz")
        assert r.status_code == 503
        assert r.json()["error"]["host"] == URLS[2]

        cluster.apps.down.clear()
        assert router.get("/readyz").status_code == 200, "ready again once the host is back"


def test_a_replica_left_out_is_asked_again_after_the_recheck_interval(runs):
    cluster = replica_cluster(runs)
    now = [0.0]
    health = Health(lambda: now[0])
    positions = RouterSettings(hosts=tuple(cluster.urls)).positions
    client = make_client(timeout_s=30, transport=cluster.apps)
    directory = Directory(positions, client, health, lambda: now[0], recheck_s=10)
    cluster.apps.down.add(REPLICA)

    async def hops() -> tuple[tuple[str, ...], ...]:
        return (await directory.models())["bt"].replicas

    assert asyncio.run(hops())[1] == (URLS[1],), "the down replica is left out"
    assert REPLICA in directory.down and not health.describe(REPLICA)["healthy"]
    cluster.apps.down.clear()
    now[0] = 9.0
    assert asyncio.run(hops())[1] == (URLS[1],), "not asked again before the interval"
    now[0] = 10.0
    assert asyncio.run(hops())[1] == (URLS[1], REPLICA), "back once asked again"
    assert directory.down == {}
