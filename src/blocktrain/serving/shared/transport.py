"""HTTP between the router and the hosts: clients with explicit timeouts, the emulated hop
latency, and transport failures mapped to errors that name the host. `DelayTransport` waits
`hop_ms` before each request and again before its response, a link of one-way latency `hop_ms`:
a traversal of H hosts costs 2 * H * hop_ms on top of loopback (docs/serving.md, "Hop latency
and the benchmark").
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import httpx

from blocktrain.errors import ConfigError
from blocktrain.serving.shared.auth import auth_headers
from blocktrain.serving.shared.serving_errors import HostTimeout, HostUnavailable, error_from_json
from blocktrain.serving.shared.wire import CONTENT_TYPE, TRACE_HEADER, TraceEntry, trace_from_header

CONNECT_TIMEOUT_S = 5.0


class DelayTransport(httpx.AsyncBaseTransport):
    """Wraps a transport; adds `delay_s` of one-way latency in each direction."""

    def __init__(self, inner: httpx.AsyncBaseTransport, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(self.delay_s)
        response = await self.inner.handle_async_request(request)
        await asyncio.sleep(self.delay_s)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def make_client(
    *,
    timeout_s: float,
    hop_ms: float = 0.0,
    transport: httpx.AsyncBaseTransport | None = None,
    secret: str | None = None,
    ca_cert: str | None = None,
) -> httpx.AsyncClient:
    """An async client for the chain: connect timeout 5 s, read/write/pool `timeout_s`, the
    hop latency, the hosts' shared secret; https hosts verified against `ca_cert` or the
    system's CAs. `transport` lets tests run hosts in-process."""
    try:
        verify = True if ca_cert is None else ssl.create_default_context(cafile=ca_cert)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use ca_cert {ca_cert}: {exc}") from None
    inner = transport or httpx.AsyncHTTPTransport(retries=0, verify=verify)
    outer: httpx.AsyncBaseTransport = DelayTransport(inner, hop_ms / 1000) if hop_ms > 0 else inner
    timeout = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
    return httpx.AsyncClient(transport=outer, timeout=timeout, headers=auth_headers(secret))


def check_url(url: str, what: str = "host URL") -> str:
    """An http(s)://HOST:PORT URL, without a trailing slash; anything else is a ConfigError."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"{what} {url!r} is not an http(s)://HOST:PORT URL")
    return url.rstrip("/")


def join(url: str, path: str) -> str:
    return url.rstrip("/") + path


async def _request(
    client: httpx.AsyncClient, method: str, url: str, path: str, **kwargs: Any
) -> httpx.Response:
    """One request to host `url`: a transport failure is HostUnavailable / HostTimeout naming it."""
    try:
        return await client.request(method, join(url, path), **kwargs)
    except httpx.TimeoutException as exc:
        raise HostTimeout(
            f"host {url} did not answer within the timeout ({type(exc).__name__})", host=url
        ) from None
    except httpx.TransportError as exc:
        raise HostUnavailable(
            f"host {url} is unavailable ({type(exc).__name__}: "
            f"{exc or 'connection lost'}); retry once it is back",
            host=url,
        ) from None


def _answer(resp: httpx.Response) -> object:
    try:
        return resp.json()
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return resp.text


async def post_message(
    client: httpx.AsyncClient, url: str, path: str, body: bytes
) -> tuple[bytes, list[TraceEntry]]:
    """POST a wire message to host `url`; -> (the answer's body, its trace). Raises
    HostUnavailable / HostTimeout naming `url`, or the error a host down the chain answered
    with (naming that host)."""
    resp = await _request(
        client, "POST", url, path, content=body, headers={"content-type": CONTENT_TYPE}
    )
    if resp.status_code != 200:
        raise error_from_json(resp.status_code, _answer(resp), default_host=url)
    return resp.content, trace_from_header(resp.headers.get(TRACE_HEADER))


async def get_json(client: httpx.AsyncClient, url: str, path: str) -> object:
    """GET a JSON document from host `url` (its info or health), with the same error mapping."""
    return await _json_call(client, "GET", url, path, None)


async def post_json(client: httpx.AsyncClient, url: str, path: str, payload: object) -> object:
    """POST a JSON document to host `url`; -> its JSON answer (the same error mapping)."""
    return await _json_call(client, "POST", url, path, payload)


async def _json_call(
    client: httpx.AsyncClient, method: str, url: str, path: str, payload: object
) -> object:
    resp = await _request(client, method, url, path, json=payload if method == "POST" else None)
    answer = _answer(resp)
    if resp.status_code != 200:
        raise error_from_json(resp.status_code, answer, default_host=url)
    return answer
