"""Hostile clients for bench/chaos.py, run inside a worker host's network namespace (standard
library only, so that it starts fast and imports no torch):

    python chaos_clients.py HOST PORT --slowloris 50 --oversized-mb 300 --seconds 60

Slowloris: `--slowloris` connections that send half a request's headers, then one header line
every few seconds, never finishing; and as many that send full headers and half a body.
Oversized: one POST of `--oversized-mb` to /v1/workers (JSON) and one to a push route, without
a token, streamed as fast as the server takes it. Prints one JSON line of what it did.
"""

from __future__ import annotations

import argparse
import json
import socket
import time


def connect(host: str, port: int) -> socket.socket | None:
    try:
        return socket.create_connection((host, port), timeout=5)
    except OSError:
        return None


def oversized(host: str, port: int, path: str, size: int, kind: str) -> str:
    """Send a body of `size` bytes (declared up front); how it ended."""
    s = connect(host, port)
    if s is None:
        return "connect_failed"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {size}\r\n\r\n"
    )
    chunk = b"[" * 65536 if "json" in kind else b"\0" * 65536
    sent = 0
    try:
        s.sendall(head.encode())
        s.settimeout(10)
        while sent < size:
            sent += s.send(chunk[: size - sent])
        answer = s.recv(200).split(b"\r\n", 1)[0].decode(errors="replace")
        return answer or "closed"
    except OSError as exc:
        return f"cut after {sent} bytes ({type(exc).__name__})"
    finally:
        s.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--slowloris", type=int, default=50)
    p.add_argument("--oversized-mb", type=int, default=300)
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    held: list[socket.socket] = []
    for i in range(args.slowloris):
        s = connect(args.host, args.port)
        if s is None:
            continue
        try:
            if i % 2:  # full headers, half the body
                s.sendall(
                    b"POST /v1/workers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 1000\r\n\r\n{"name": "'
                )
            else:  # half the headers
                s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        except OSError:
            s.close()
    size = args.oversized_mb * 2**20
    outcomes = {
        "register": oversized(args.host, args.port, "/v1/workers", size, "application/json"),
        "push": oversized(
            args.host, args.port, "/v1/blocks/0/updates", size, "application/vnd.safetensors"
        ),
    }
    limit = time.monotonic() + args.seconds
    while time.monotonic() < limit:  # trickle a header line now and then; count the dropped
        time.sleep(min(5.0, max(0.0, limit - time.monotonic())))
        for s in list(held):
            try:
                s.sendall(b"X-a: b\r\n")
            except OSError:
                held.remove(s)
                s.close()
    print(
        json.dumps({"slowloris": args.slowloris, "still_open": len(held), "oversized": outcomes}),
        flush=True,
    )
    for s in held:
        s.close()


if __name__ == "__main__":
    main()
