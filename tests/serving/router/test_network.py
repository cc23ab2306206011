"""Real servers on loopback (marked `network`; run with `pytest -m network tests/serving`):
the official openai client against a router and three uvicorn block hosts, and a host process
killed in the middle of a request."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from blocktrain.listener import ThreadedServer, bind, url_of
from blocktrain.model import Sampling, utf8
from blocktrain.serving import (
    HostSettings,
    ModelSource,
    RouterSettings,
    create_host_app,
    create_router_app,
)
from blocktrain.tls import TlsFiles
from tests.serving.conftest import in_process

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]


@contextlib.contextmanager
def loopback_chain(
    runs,
    hosts: int = 3,
    secret: str | None = None,
    tls: TlsFiles | None = None,
    **host_settings: object,
) -> Iterator[tuple[str, list[str]]]:
    servers: list[ThreadedServer] = []
    try:
        urls = []
        for i in range(hosts):
            sock = bind("127.0.0.1", 0)
            settings = HostSettings(
                models=(ModelSource("bt", runs.blocktrain), ModelSource("ref", runs.reference)),
                parts=(i,),
                public_url=url_of(sock, tls=tls is not None),
                secret=secret,
                **host_settings,  # type: ignore[arg-type]
            )
            servers.append(ThreadedServer.start(create_host_app(settings), sock, tls=tls))
            urls.append(servers[-1].url)
        sock = bind("127.0.0.1", 0)
        ca = None if tls is None else tls.cert
        router = create_router_app(RouterSettings(tuple(urls), secret=secret, ca_cert=ca))
        servers.append(ThreadedServer.start(router, sock))
        yield servers[-1].url, urls
    finally:
        for server in reversed(servers):
            server.stop()


def test_the_openai_client_works_unchanged(runs, stack):
    with loopback_chain(runs) as (router, _):
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0, timeout=60)
        assert {m.id for m in client.models.list()} == {"bt", "ref"}
        done = client.completions.create(model="bt", prompt="The game ", max_tokens=9, seed=5)
        assert done.usage is not None and done.usage.completion_tokens == 9
        drawn = bytes(in_process(stack, b"The game ", 9, 5, Sampling(utf8=True)))  # the default
        expected = drawn[: utf8.complete_length(drawn)].decode("utf-8")
        assert done.choices[0].text == expected, "across real sockets, still bit for bit"
        streamed = client.completions.create(
            model="bt", prompt="The game ", max_tokens=9, seed=5, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected
        baseline = client.completions.create(
            model="ref", prompt="The game ", max_tokens=6, temperature=0
        )
        assert baseline.usage is not None and baseline.usage.completion_tokens == 6
        with pytest.raises(openai.BadRequestError, match="at least one byte"):
            client.completions.create(model="bt", prompt="", max_tokens=3)
        with pytest.raises(openai.NotFoundError, match="not served here"):
            client.completions.create(model="gpt-4", prompt="a", max_tokens=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_host(run, block: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "blocktrain.cli.main",
            "serve-block",
            f"bt={run}",
            "--blocks",
            str(block),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"host {url} exited with {proc.returncode}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"host {url} did not come up")


def test_a_host_killed_mid_request_gives_503_naming_it_then_serving_resumes(runs):
    ports = [_free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [_start_host(runs.blocktrain, i, p) for i, p in enumerate(ports)]
    router = None
    try:
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc)
        # Each link to a host takes 0.4 s each way: host 2 dies while the state is on its way.
        router = ThreadedServer.start(
            create_router_app(RouterSettings(tuple(urls), hop_ms=400)), bind("127.0.0.1", 0)
        )
        request = {"model": "bt", "prompt": "The ", "max_tokens": 2, "seed": 1}
        ok = httpx.post(f"{router.url}/v1/completions", json=request, timeout=60)
        assert ok.status_code == 200, ok.text

        answer: dict[str, httpx.Response] = {}
        worker = threading.Thread(
            target=lambda: answer.update(
                r=httpx.post(f"{router.url}/v1/completions", json=request, timeout=60)
            )
        )
        worker.start()
        time.sleep(0.5)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(10)
        worker.join(60)
        r = answer["r"]
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["host"] == urls[2] and urls[2] in err["message"], err

        procs[2] = _start_host(runs.blocktrain, 2, ports[2])
        _wait_healthy(urls[2], procs[2])
        again = httpx.post(f"{router.url}/v1/completions", json=request, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
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


def test_over_sockets_hosts_want_the_secret_and_cut_chunked_uploads_at_their_cap(runs):
    """Router and hosts authenticate each other (once, any process could run work on a host),
    and chunked uploads, which once bypassed the hosts' body limit, are cut at it; here through
    uvicorn on loopback, as deployed."""
    secret = "loopback-test-secret-0123456789"
    with loopback_chain(runs, secret=secret, max_body_bytes=64 * 1024) as (router, hosts):
        r = httpx.post(
            f"{router}/v1/generate",
            json={"model": "bt", "prompt": "The ", "max_bytes": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert httpx.post(f"{hosts[0]}/v1/sweep", content=b"x").status_code == 401
        sent = 0

        def chunks() -> Iterator[bytes]:
            nonlocal sent
            for _ in range(4096):  # 64 MiB if nothing stopped it
                sent += 16 * 1024
                yield b"\0" * (16 * 1024)

        auth = {"authorization": f"Bearer {secret}"}
        try:
            big = httpx.post(f"{hosts[0]}/v1/sweep", content=chunks(), headers=auth, timeout=30)
            assert big.status_code == 413, big.text
        except httpx.HTTPError:
            pass  # the host answered 413 and closed while the client was still sending
        assert sent < 8 * 1024 * 1024, f"{sent} bytes went out before the host refused"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_hosts_on_https_with_a_self_signed_certificate(runs, tmp_path):
    """The shared secret crosses the network inside TLS; the router
    verifies the hosts against the certificate it is given (--set ca_cert)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    tls = TlsFiles(str(cert), str(key))
    with loopback_chain(runs, secret="tls-test-secret-0123456789", tls=tls) as (router, hosts):
        assert all(url.startswith("https://") for url in hosts)
        r = httpx.post(
            f"{router}/v1/generate",
            json={"model": "bt", "prompt": "The ", "max_bytes": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(f"{hosts[0]}/healthz")
        assert (
            httpx.get(
                f"{hosts[0]}/healthz", verify=ssl.create_default_context(cafile=cert)
            ).status_code
            == 200
        )
