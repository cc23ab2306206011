"""The floor under the aggregator's push latency: what the HTTP path alone costs a burst of
pushes on this machine, with no protocol behind it.

A server process runs the aggregator's HTTP stack (uvicorn through `listener.run`, with its
guarded h11 protocol; FastAPI; `HttpGuard`; `read_body`; the request thread of `anyio.to_thread`)
with one route that does, per variant:

    read    read the body into its buffer and answer its length
    write   the same, and write the body durably as the aggregator writes a pending update
            (`fsutil.atomic_write_bytes`), removed again

N workers (bench/load_http.py, as bench/protocol_load.py's) push a body of the same size as
protocol_load's fp16 delta of 1M parameters at one moment, for a few rounds. Whatever the
aggregator does beyond this (the parse, the checks, the sketches, the ledger, the pulls, the
commit) comes on top of these figures.

    python bench/push_floor.py          # 100 workers, 3 rounds, each variant twice, alternated

Writes benchmarks/results/push_floor.json; BENCHMARKS.md "Aggregator under load" cites it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the route's annotations here

from load_http import Connection  # beside this script
from protocol_load import cpu_seconds, percentile
from report import free_ports, machine, wait_healthy, write_json

BODY_BYTES = 2_097_448  # protocol_load's body: 1M fp16 values and their header
VARIANTS = ("read", "write")


def serve(port: int, variant: str, folder: Path) -> None:
    """The server process: one route, POST /push, on the aggregator's HTTP stack."""
    from blocktrain.runtime import serve_from_heap

    serve_from_heap()  # as the CLI does for its servers
    import anyio
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from blocktrain.fsutil import atomic_write_bytes
    from blocktrain.httpserve import HttpGuard, Limits, read_body
    from blocktrain.listener import run

    def handle(body: bytearray) -> dict[str, int]:
        if variant == "write":
            path = folder / f"{uuid.uuid4().hex}.safetensors"
            atomic_write_bytes(path, body)
            path.unlink()
        return {"bytes": len(body)}

    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/push")
    async def push(request: Request) -> JSONResponse:
        body = await read_body(request.scope, request.stream())
        return JSONResponse(await anyio.to_thread.run_sync(handle, body))

    limits = dataclasses.replace(Limits(), max_connections=4096, max_connections_per_address=4096)
    app.add_middleware(HttpGuard, limits=limits, body_limit=lambda scope: 4 * BODY_BYTES)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    run(app, sock, limits)


async def bursts(url: str, workers: int, rounds: int) -> list[list[float]]:
    """Each round's push latencies (ms, first byte to answer), all workers at one moment."""
    bodies = [os.urandom(BODY_BYTES) for _ in range(workers)]
    conns = [Connection(url) for _ in range(workers)]

    async def push(conn: Connection, body: bytes, latencies: list[float]) -> None:
        t0 = time.perf_counter()
        answer = await conn.request("POST", "/push", {}, body)
        if answer.status != 200:
            raise RuntimeError(f"push answered {answer.status}: {answer.body[:200]!r}")
        latencies.append(1000 * (time.perf_counter() - t0))

    for conn in conns:  # connected before the first burst, as protocol_load's workers are
        await push(conn, b"0", [])
    out = []
    for _ in range(rounds):
        latencies: list[float] = []
        await asyncio.gather(*(push(c, b, latencies) for c, b in zip(conns, bodies, strict=True)))
        out.append(latencies)
        await asyncio.sleep(0.5)
    for c in conns:
        await c.close()
    return out


def measure(variant: str, workers: int, rounds: int) -> dict[str, Any]:
    (port,) = free_ports(1)
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port), variant, folder],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}", [proc], timeout_s=60)
            cpu0 = cpu_seconds(proc.pid)
            rounds_ms = asyncio.run(bursts(f"http://127.0.0.1:{port}", workers, rounds))
            cpu = cpu_seconds(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait(10)
    every = [ms for r in rounds_ms for ms in r]
    return {
        "variant": variant,
        "workers": workers,
        "rounds": rounds,
        "body_bytes": BODY_BYTES,
        "push": {
            "p50_ms": statistics.median(every),
            "p99_ms": percentile(every, 99),
            "max_ms": max(every),
            "p99_ms_per_round": [percentile(r, 99) for r in rounds_ms],
        },
        "server_cpu_ms_per_push": 1000 * cpu / (workers * rounds),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternated")
    p.add_argument("--no-write", action="store_true", help="print only; write no JSON")
    args = p.parse_args()
    rows = []
    for _ in range(args.repeats):
        for variant in VARIANTS:
            rows.append(measure(variant, args.workers, args.rounds))
            r = rows[-1]
            print(
                f"{variant:6s} push p50 / p99 {r['push']['p50_ms']:.0f} / "
                f"{r['push']['p99_ms']:.0f} ms, server CPU {r['server_cpu_ms_per_push']:.1f} ms "
                "a push",
                flush=True,
            )
    if not args.no_write:
        print("wrote", write_json("push_floor.json", {"rows": rows, "machine": machine()}))


if __name__ == "__main__":
    main()
