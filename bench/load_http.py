"""A lean HTTP/1.1 client for load benches: asyncio streams, one request at a time per
connection, bodies sent and read as whole `bytes`.

httpx spends about as much CPU per 2 MB body as the aggregator does to parse, validate and
store it; on a 2-core machine where the simulated fleet and the server share the cores, that
client, not the server, would set the latency measured. This one does only what a load generator
must: write the request head and the prebuilt body, read the head, then exactly Content-Length
bytes (every answer of the aggregator carries one).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


class Connection:
    """One keep-alive connection to `url` (http only), reopened when the server closed it."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20
            )
        return self._reader, self._writer

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes = b""
    ) -> Answer:
        reader, writer = await self._open()
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body or method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        if body:
            writer.write(body)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        got: dict[str, str] = {}
        for line in header_lines:
            if ":" in line:
                key, value = line.split(":", 1)
                got[key.strip().lower()] = value.strip()
        data = await reader.readexactly(int(got.get("content-length", "0")))
        if got.get("connection", "").lower() == "close":
            await self.close()
        return Answer(int(status_line.split()[1]), got, data)
