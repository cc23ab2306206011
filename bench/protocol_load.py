"""Load on the aggregator: N concurrent simulated workers pushing deltas of a 1M-parameter block.

A real aggregator process (uvicorn, the same `blocktrain aggregator` command) serves one
synthetic block of `--params` parameters; N asyncio workers in this process, each with its own
token, register, then for each round: wait for the round, pull the weights (fp16), and push an
fp16 delta at once (no training), all N at the same moment. Every push goes the whole way:
safetensors parse, validation (names, shapes, dtypes, finite, norm), fsync of the body, ledger
row, accumulation; the round closes when all N have reported.

Reports push latency (p50/p99, from the first byte sent to the answer), accepted updates per
second and MB/s over each round's push phase, and the same for pulls.

    python bench/protocol_load.py                       # 100 workers, 1M params, 5 rounds
    python bench/protocol_load.py --workers 20 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from blocktrain.protocol.cluster import start_aggregator, stop
from blocktrain.protocol.settings import AggregatorSettings
from blocktrain.protocol.storage import StateDir
from blocktrain.protocol.tokens import hash_token, new_token
from blocktrain.protocol.wire import CONTENT_TYPE, encode
from report import machine, update_section, write_json  # bench/report.py, beside this script


def block(params: int) -> dict[str, torch.Tensor]:
    """A synthetic block: two matrices and a bias, `params` parameters in all."""
    cols = 512
    rows = (params - cols) // (2 * cols)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w_in": torch.randn(rows, cols, generator=gen) * 0.02,
        "w_out": torch.randn(cols, rows, generator=gen) * 0.02,
        "bias": torch.zeros(params - 2 * rows * cols),
    }
    return tensors


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def worker(
    client: httpx.AsyncClient,
    token: str,
    rounds: int,
    delta: dict[str, Any],
    start: asyncio.Barrier,
    log: dict[str, list],
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    r = await client.post("/v1/workers", json={"block": 0}, headers=headers)
    r.raise_for_status()
    wid = r.json()["worker_id"]
    headers["X-Worker-Id"] = str(wid)
    last = -1
    for _ in range(rounds):
        while True:  # long poll for the next round
            info = (
                await client.get(
                    "/v1/blocks/0/round", params={"after": last, "wait": 30}, headers=headers
                )
            ).json()
            if info["round"] > last:
                break
        await start.wait()  # every worker pulls, then pushes, at the same moment
        t0 = time.perf_counter()
        pulled = await client.get("/v1/blocks/0", headers=headers)
        t1 = time.perf_counter()
        pulled.raise_for_status()
        round_ = int(pulled.headers["X-Round"])
        version = int(pulled.headers["X-Version"])
        body = encode(
            delta,
            {
                "block": 0,
                "base_version": version,
                "round": round_,
                "tokens": 4096,
                "worker_id": wid,
            },
            "fp16",
        )
        await start.wait()
        t2 = time.perf_counter()
        pushed = await client.post(
            "/v1/blocks/0/updates", content=body, headers={**headers, "Content-Type": CONTENT_TYPE}
        )
        t3 = time.perf_counter()
        log["pull"].append((round_, t0, t1, len(pulled.content)))
        log["push"].append(
            (round_, t2, t3, len(body), pushed.status_code, pushed.json().get("reason", ""))
        )
        last = round_


async def drive(url: str, tokens: list[str], rounds: int, params: int) -> dict[str, list]:
    delta = {k: torch.full_like(v, 1e-3) for k, v in block(params).items()}
    log: dict[str, list] = {"pull": [], "push": []}
    limits = httpx.Limits(max_connections=len(tokens) + 8, max_keepalive_connections=len(tokens))
    timeout = httpx.Timeout(connect=30, read=300, write=300, pool=300)
    start = asyncio.Barrier(len(tokens))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client, t, rounds, delta, start, log) for t in tokens))
    return log


def phase(entries: list[tuple], nbytes_index: int) -> dict[str, float]:
    """Latency percentiles and throughput of one kind of request, per round then overall."""
    latencies = [e[2] - e[1] for e in entries]
    by_round: dict[int, list[tuple]] = {}
    for e in entries:
        by_round.setdefault(e[0], []).append(e)
    walls = [max(e[2] for e in es) - min(e[1] for e in es) for es in by_round.values()]
    total_bytes = sum(e[nbytes_index] for e in entries)
    wall = sum(walls)
    return {
        "requests": len(entries),
        "p50_ms": 1e3 * percentile(latencies, 50),
        "p99_ms": 1e3 * percentile(latencies, 99),
        "max_ms": 1e3 * max(latencies),
        "mean_ms": 1e3 * statistics.fmean(latencies),
        "per_s": len(entries) / wall,
        "mb_per_s": total_bytes / wall / 1e6,
        "wall_s_per_round": walls,
        "bytes": total_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=100)
    p.add_argument("--params", type=int, default=1_048_576)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tensors = block(args.params)
        n_params = sum(t.numel() for t in tensors.values())
        settings = AggregatorSettings(
            deadline_s=300.0,
            local_steps=1,
            max_delta_norm=1e6,
            max_tokens=1 << 20,
            keep_versions=1,
            n_workers=args.workers,
        )
        state = StateDir.create(
            Path(tmp) / "state",
            run_config={"seed": 0, "bench": True},
            settings=settings,
            blocks={0: tensors},
        )
        tokens = []
        for i in range(args.workers):
            tokens.append(new_token())
            state.ledger.add_token(f"w{i}", hash_token(tokens[-1]), time.time())
        proc, url = start_aggregator(state, Path(tmp) / "logs")
        try:
            started = time.perf_counter()
            log = asyncio.run(drive(url, tokens, args.rounds, args.params))
            elapsed = time.perf_counter() - started
            versions = state.ledger.block_state(0)[0]
        finally:
            stop([proc])
            state.close()
    refused = [e for e in log["push"] if e[4] != 200]
    result = {
        "workers": args.workers,
        "params": n_params,
        "rounds": args.rounds,
        "wire_dtype": "fp16",
        "body_bytes": log["push"][0][3],
        "push": phase(log["push"], 3),
        "pull": phase(log["pull"], 3),
        "accepted": len(log["push"]) - len(refused),
        "refused": len(refused),
        "refusal_reasons": sorted({e[5] for e in refused}),
        "final_version": versions,
        "elapsed_s": elapsed,
        "machine": machine(),
    }
    path = write_json("protocol_load.json", result)
    push, pull = result["push"], result["pull"]
    print(
        f"{args.workers} workers x {args.rounds} rounds, {n_params:,} params "
        f"({result['body_bytes'] / 1e6:.2f} MB per fp16 delta): push p50 {push['p50_ms']:.0f} "
        f"ms, p99 {push['p99_ms']:.0f} ms, {push['per_s']:.1f} updates/s, "
        f"{push['mb_per_s']:.1f} MB/s; pull {pull['per_s']:.1f}/s, {pull['mb_per_s']:.1f} "
        f"MB/s; {result['refused']} refused; wrote {path}"
    )
    if args.no_write:
        return
    update_section(
        "protocol-load",
        f"""
### Aggregator under load: {args.workers} concurrent workers, {n_params:,}-parameter block

Command: `python bench/protocol_load.py --workers {args.workers} --rounds {args.rounds}` (writes
`benchmarks/results/protocol_load.json`). One real aggregator process (uvicorn) on loopback; {args.workers}
simulated workers (asyncio, one token each) pull the block and push an fp16 delta
({result["body_bytes"] / 1e6:.2f} MB) all at the same moment, {args.rounds} rounds. Every push is parsed,
validated (names, shapes, dtypes, finite, norm), its body fsynced and its ledger row committed
before the answer; each round closes when all {args.workers} have reported.

| | p50 latency | p99 latency | requests/s | MB/s |
|---|---:|---:|---:|---:|
| push (delta up) | {push["p50_ms"]:.0f} ms | {push["p99_ms"]:.0f} ms | {push["per_s"]:.1f} | {push["mb_per_s"]:.1f} |
| pull (weights down) | {pull["p50_ms"]:.0f} ms | {pull["p99_ms"]:.0f} ms | {pull["per_s"]:.1f} | {pull["mb_per_s"]:.1f} |

{result["accepted"]} updates accepted, {result["refused"]} refused; final version {versions}.
Latency counts from the request's first byte to the answer, so with {args.workers} pushes in flight it
is mostly queueing: the push phase of a round lasts about {statistics.fmean(push["wall_s_per_round"]):.1f} s. Measured on
{result["machine"]["cpu"]} ({result["machine"]["cores"]} cores, shared with other work; client and server on the same cores).
""",
    )


if __name__ == "__main__":
    main()
