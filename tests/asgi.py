"""One request straight into an ASGI app, with the body fed chunk by chunk, so that a test can
see how much of the body the server pulled before it answered (limits before parsing)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    chunks_pulled: int
    bytes_pulled: int
    headers: dict[str, str]


def asgi_request(
    app: Any,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    chunks: Iterable[bytes] = (),
    *,
    delay_s: float = 0.0,
    chunked: bool = False,
) -> Answer:
    """`chunks` may be endless; after the last one a client that is asked for more stalls (it
    never finishes its body). `delay_s` before each chunk makes a slow client; `chunked` sends
    `Transfer-Encoding: chunked` (no Content-Length)."""
    source = iter(chunks)
    ahead = next(source, None)
    pulled = [0, 0]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal ahead
        if ahead is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(delay_s)
        chunk, ahead = ahead, next(source, None)
        assert chunk is not None
        pulled[0] += 1
        pulled[1] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": ahead is not None}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"transfer-encoding", b"chunked")] * chunked + raw,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return Answer(start["status"], body, pulled[0], pulled[1], headers)


def answered_by(app: Any, request: Any) -> Any:
    """An httpx request answered by a TestClient `app` (for an httpx.MockTransport handler):
    how a test puts a real client in front of an in-process aggregator."""
    import httpx

    r = app.request(
        request.method,
        str(request.url),
        headers=request.headers,
        content=request.content,
        follow_redirects=False,
    )
    return httpx.Response(r.status_code, headers=r.headers, content=r.content)
