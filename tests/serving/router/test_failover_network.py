"""Failover across real processes (marked `network`; run with `pytest -m network tests/serving`):
one of two replicas of block 1 is killed (SIGKILL) in the middle of a streamed completion and the
stream completes with the same bytes; with both replicas dead, a clear 503 names the block."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import pytest

from blocktrain.listener import ThreadedServer, bind
from blocktrain.model import Sampling, utf8
from blocktrain.serving import RouterSettings, create_router_app
from tests.serving.conftest import in_process
from tests.serving.router.test_network import _free_port, _start_host, _wait_healthy

pytestmark = [pytest.mark.network, pytest.mark.timeout(240)]


def test_a_replica_killed_mid_stream_and_then_none_left(runs, stack):
    blocks = [0, 1, 1, 2]
    ports = [_free_port() for _ in blocks]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [_start_host(runs.blocktrain, b, p) for b, p in zip(blocks, ports, strict=True)]
    router = None
    try:
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc)
        hosts = (urls[0], f"{urls[1]}|{urls[2]}", urls[3])
        # 50 ms each way per link: a span takes ~0.3 s, so the stream is still going when the
        # replica dies.
        settings = RouterSettings(hosts, hop_ms=50)
        router = ThreadedServer.start(create_router_app(settings), bind("127.0.0.1", 0))
        assert httpx.get(f"{router.url}/readyz", timeout=60).status_code == 200

        request = {"model": "bt", "prompt": "The ", "max_tokens": 24, "seed": 3, "stream": True}
        events: list[str] = []
        killed = None
        with httpx.stream("POST", f"{router.url}/v1/completions", json=request, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:  # two spans in: kill the replica this stream is on
                    jobs = [
                        httpx.get(f"{u}/v1/info", timeout=10).json()["batching"]["jobs"]
                        for u in urls[1:3]
                    ]
                    # the readiness sweep ran one job on each; the stream's spans on its own
                    killed = 1 if jobs[0] > jobs[1] else 2
                    procs[killed].send_signal(signal.SIGKILL)
                    procs[killed].wait(10)
        assert killed is not None
        assert events[-1] == "data: [DONE]", events[-1]
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        drawn = bytes(in_process(stack, b"The ", 24, 3, Sampling(utf8=True)))  # the default
        assert text == drawn[: utf8.complete_length(drawn)].decode("utf-8")

        survivor = 3 - killed
        procs[survivor].send_signal(signal.SIGKILL)
        procs[survivor].wait(10)
        r = httpx.post(
            f"{router.url}/v1/generate", json={"model": "bt", "prompt": "ab"}, timeout=60
        )
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] in ("no_replica", "host_unavailable"), err
        assert urls[1] in err["message"] or urls[2] in err["message"], err
        ready = httpx.get(f"{router.url}/readyz", timeout=60)
        assert ready.status_code == 503, ready.text
    finally:
        if router is not None:
            router.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
