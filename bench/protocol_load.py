"""Load on the aggregator: N simulated workers pulling and pushing fp16 deltas of 1M-parameter
blocks, against one aggregator process or one per block.

Real aggregator processes (the `blocktrain aggregator` command, uvicorn, loopback) serve
synthetic blocks of `--params` parameters; N asyncio workers in this process, each with its own
token (known to every aggregator), register on block `i % blocks`, then for each round: pull
the weights as the worker's client does (`?redirect=1`, then the version's immutable URL) and
push an fp16 delta (no training). Every push goes the whole way: safetensors parse, validation
(names, shapes, dtypes, finite, norm), fsync of the body, ledger row, accumulation; a round
closes when all of its block's workers have reported (quorum 1).

Arrival. `burst`: all N pull at one moment, then all push at one moment (the worst case; the
rounds of the first table in BENCHMARKS.md). `staggered`: each worker pulls at a uniformly
random moment within `--spread` seconds of its round's opening and pushes a uniformly random
time within `--spread` after its pull, as workers that finish their local steps at different
times do within a deadline round, over a connection of its own per round (a worker idle for
minutes between rounds would open a new one). Each worker long-polls for its round, as the
worker's client does.

The workers speak HTTP/1.1 through `load_http.Connection` (asyncio streams, the body prebuilt,
one per block and round): with httpx, the load generator used more CPU than the aggregator on
the same 2 cores (measured: 12.5 s against 7.0 s for 100 workers x 3 rounds).

Reports push and pull latency (p50/p99 from the request's first byte to the answer; a pull is
the 303 and the version's body), accepted updates per second and MB/s over each round's phase,
and the aggregators' CPU seconds (user + system, all requests) per accepted update.

    python bench/protocol_load.py                    # the runs of BENCHMARKS.md (~5 minutes)
    python bench/protocol_load.py --quick --no-write # 20 and 60 workers, a smoke test
    python bench/protocol_load.py --baseline fe4cdbc # each run also against that commit's
                                                     # aggregator, interleaved: A, B, A, B...

With `--baseline REV`, `git archive REV src` is exported to a temporary folder and each
configuration runs first with that revision's aggregator (PYTHONPATH at its src/), then with
this checkout's, so that the machine's noise (it is shared) hits both alike; the JSON keeps this
checkout's rows where they were and the baseline's under `baseline`, each with its commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blocktrain.protocol.core.bodies import CONTENT_TYPE, encode
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.ops.cluster import Proc, start_aggregator, stop
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from load_http import Connection  # bench/load_http.py, beside this script
from protocol_load_md import profile_text, row, section  # beside this script: table, prose
from protocol_revisions import Revision, export, python_path, this_checkout  # beside this script
from report import RESEARCH, RESULTS, free_ports, machine, update_section, write_json

Tensors = dict[str, torch.Tensor]


def block(params: int) -> Tensors:
    """A synthetic block: two matrices and a bias, `params` parameters in all."""
    cols = 512
    rows = (params - cols) // (2 * cols)
    gen = torch.Generator().manual_seed(0)
    return {
        "w_in": torch.randn(rows, cols, generator=gen) * 0.02,
        "w_out": torch.randn(cols, rows, generator=gen) * 0.02,
        "bias": torch.zeros(params - 2 * rows * cols),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass(frozen=True)
class Run:
    workers: int
    aggregators: int
    blocks: int
    arrival: str  # burst | staggered
    rounds: int
    spread_s: float = 0.0


@dataclass
class Fleet:
    """The aggregators of one run and what the workers need to reach them."""

    procs: list[Proc]
    url_of_block: dict[int, str]
    tokens: list[str]
    states: list[StateDir]
    log: dict[str, list] = field(default_factory=lambda: {"pull": [], "push": []})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def aggregator_extra(rev: Revision, run: Run, k: int, urls: list[str]) -> list[str]:
    """The bench's flags for aggregator k of `run`, as revision `rev` spells them."""
    cap = str(2 * run.workers + 64)  # every worker is on loopback: one address holds them all
    flags = rev.flags()
    extra = []
    for flag, value in (("--max-connections", cap), ("--max-connections-per-address", cap)):
        name = flag.removeprefix("--").replace("-", "_")
        extra += [flag, value] if flag in flags else ["--set", f"{name}={value}"]
    if run.aggregators > 1:  # one per block
        extra += ["--blocks", str(k)]
        extra += [f"--peer={j}={urls[j]}" for j in range(run.aggregators) if j != k]
    return extra


def start_fleet(root: Path, run: Run, params: int, rev: Revision | None = None) -> Fleet:
    """`run.aggregators` processes: one serving every block, or one per block (`--blocks`,
    `--peer`), each with its own state folder holding the same version 0; from `rev`'s
    src/ (default: whatever the PYTHONPATH of this process says)."""
    settings = AggregatorSettings(
        deadline_s=600.0,
        min_round_s=0.0,  # the load, not the round length, is measured
        local_steps=1,
        max_delta_norm=1e6,
        max_tokens=1 << 20,
        keep_versions=2,
        n_workers=run.workers,
        effect_probe="off",  # synthetic blocks: no model to probe
        quorum=1.0,
    )
    tensors = block(params)
    tokens = [new_token() for _ in range(run.workers)]
    ports = free_ports(run.aggregators)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    fleet = Fleet([], {}, tokens, [])
    for k in range(run.aggregators):
        state = StateDir.create(
            root / f"state{k}",
            run_config={"seed": 0, "bench": True},
            settings=settings,
            blocks={b: tensors for b in range(run.blocks)},
        )
        if rev is not None:  # another revision's aggregator reads only the settings it knows
            doc = state.manifest()
            known = rev.settings_fields()
            doc["settings"] = {k: v for k, v in doc["settings"].items() if k in known}
            state._write_manifest(doc)
        for i, token in enumerate(tokens):
            state.ledger.add_token(f"w{i}", hash_token(token), time.time())
        extra = aggregator_extra(rev or this_checkout(), run, k, urls)
        with python_path(rev.src) if rev is not None else contextlib.nullcontext():
            proc, url = start_aggregator(
                state, root / "logs", port=ports[k], extra=extra, name=f"aggregator{k}"
            )
        fleet.procs.append(proc)
        fleet.states.append(state)
        served = range(run.blocks) if run.aggregators == 1 else [k]
        fleet.url_of_block.update({b: url for b in served})
    return fleet


def worker_deltas(params: int, workers: int, rounds: int) -> Callable[[int, int], Tensors]:
    """delta(i, round): worker i's delta in a round, a window of one random pool (1e-3 a
    coordinate) at an offset of its own, so that no two pushes are near-copies (the replay
    screen refuses those as `copy` or `replay`) and no body costs a random draw."""
    shapes = {k: v.shape for k, v in block(params).items()}
    offsets = workers * (rounds + 1)
    pool = torch.randn(params + offsets, generator=torch.Generator().manual_seed(1)).half()

    def delta(i: int, round_: int) -> Tensors:
        at = (i + workers * round_) % offsets
        out = {}
        for k, shape in shapes.items():
            n = shape.numel()
            out[k], at = pool[at : at + n].view(shape) * 1e-3, at + n
        return out

    return delta


async def drive(fleet: Fleet, run: Run, params: int) -> None:
    """Every worker through `run.rounds` rounds; fills `fleet.log`."""
    delta = worker_deltas(params, run.workers, run.rounds)
    barrier = asyncio.Barrier(run.workers)
    rng = random.Random(0)

    async def arrive() -> None:
        if run.arrival == "burst":
            await barrier.wait()
        else:
            await asyncio.sleep(rng.uniform(0, run.spread_s))

    async def worker(i: int) -> None:
        b = i % run.blocks
        conn = Connection(fleet.url_of_block[b])
        headers = {"Authorization": f"Bearer {fleet.tokens[i]}"}
        r = await conn.request("POST", "/v1/workers", headers, json.dumps({"block": b}).encode())
        headers["X-Worker-Id"] = str(json.loads(r.body)["worker_id"])
        last = -1
        for _ in range(run.rounds):
            while True:  # the worker's long poll for the next round
                path = f"/v1/blocks/{b}/round?after={last}&wait=30"
                info = json.loads((await conn.request("GET", path, headers)).body)
                if info["round"] > last:
                    break
            round_ = last = info["round"]
            await arrive()
            t0 = time.perf_counter()
            moved = await conn.request("GET", f"/v1/blocks/{b}?redirect=1", headers)
            pulled = await conn.request("GET", moved.headers["location"], headers)
            t1 = time.perf_counter()
            version = int(moved.headers["x-version"])
            meta = {"block": b, "base_version": version, "round": round_, "tokens": 4096}
            body = encode(delta(i, round_), meta, "fp16")
            await arrive()
            t2 = time.perf_counter()
            push_headers = {**headers, "Content-Type": CONTENT_TYPE}
            pushed = await conn.request("POST", f"/v1/blocks/{b}/updates", push_headers, body)
            t3 = time.perf_counter()
            if run.arrival == "staggered":  # idle until the next round: a new connection then
                await conn.close()
            reason = "" if pushed.status == 200 else json.loads(pushed.body).get("reason", "")
            fleet.log["pull"].append(((b, round_), t0, t1, len(pulled.body)))
            fleet.log["push"].append(((b, round_), t2, t3, len(body), pushed.status, reason))
        await conn.close()

    async with asyncio.TaskGroup() as group:  # one failing worker stops the run, not a hang
        for i in range(run.workers):  # at the barrier, where the others would wait for it
            group.create_task(worker(i))


def phase(entries: list[tuple], nbytes_index: int = 3) -> dict[str, Any]:
    """Latency percentiles and throughput of one kind of request: per (block, round) phase,
    from its first request's start to its last answer, then overall."""
    latencies = [e[2] - e[1] for e in entries]
    by_round: dict[Any, list[tuple]] = {}
    for e in entries:
        by_round.setdefault(e[0], []).append(e)
    walls = [max(e[2] for e in es) - min(e[1] for e in es) for es in by_round.values()]
    # blocks overlap in time: throughput over the union of each round index's phases
    spans: dict[int, tuple[float, float]] = {}
    for (_, r), es in by_round.items():
        lo, hi = min(e[1] for e in es), max(e[2] for e in es)
        old = spans.get(r, (lo, hi))
        spans[r] = (min(old[0], lo), max(old[1], hi))
    wall = sum(hi - lo for lo, hi in spans.values())
    total_bytes = sum(e[nbytes_index] for e in entries)
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


def measure(run: Run, params: int, rev: Revision) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = start_fleet(Path(tmp), run, params, rev)
        try:
            cpu0 = [cpu_seconds(p.popen.pid) for p in fleet.procs]
            started = time.perf_counter()
            asyncio.run(drive(fleet, run, params))
            elapsed = time.perf_counter() - started
            cpu = sum(cpu_seconds(p.popen.pid) - c for p, c in zip(fleet.procs, cpu0, strict=True))
        finally:
            stop(fleet.procs)
        versions = [fleet.states[k if run.aggregators > 1 else 0].ledger.block_state(b)[0]
                    for k, b in enumerate(range(run.blocks))]  # fmt: skip
        for state in fleet.states:
            state.close()
    log = fleet.log
    refused = [e for e in log["push"] if e[4] != 200]
    accepted = len(log["push"]) - len(refused)
    return {
        "commit": rev.commit,
        "workers": run.workers,
        "aggregators": run.aggregators,
        "blocks": run.blocks,
        "arrival": run.arrival,
        "spread_s": run.spread_s,
        "params": params,
        "rounds": run.rounds,
        "wire_dtype": "fp16",
        "body_bytes": log["push"][0][3],
        "push": phase(log["push"]),
        "pull": phase(log["pull"]),
        "accepted": accepted,
        "refused": len(refused),
        "refusal_reasons": sorted({e[5] for e in refused}),
        "final_versions": versions,
        "aggregator_cpu_s": cpu,
        "aggregator_cpu_s_per_update": cpu / max(1, accepted),
        "elapsed_s": elapsed,
        "load_average_1min_after": os.getloadavg()[0],  # the machine is shared: how busy it was
    }


def attempt(run: Run, params: int, rev: Revision) -> dict[str, Any]:
    """`measure`, or the run's configuration and what stopped it (a worker's request failed:
    the aggregator closed a connection, say), so that one revision's failure still leaves the
    other's rows, and says so in the table."""
    try:
        return measure(run, params, rev)
    except Exception as exc:  # an exception group of the workers' TaskGroup too
        first: BaseException = exc
        while getattr(first, "exceptions", None):  # the first worker's failure in the group
            first = first.exceptions[0]  # type: ignore[attr-defined]
        fields = ("workers", "aggregators", "blocks", "arrival", "spread_s", "rounds")
        return {"commit": rev.commit, **{k: getattr(run, k) for k in fields},
                "params": params, "failed": f"{type(first).__name__}: {first}"[:200]}  # fmt: skip


def runs_of(args: argparse.Namespace) -> list[Run]:
    """The first is the comparison with earlier measurements (its keys are the JSON's top
    level): N workers on one block of one aggregator, in bursts."""
    small, large = args.workers, args.large
    return [
        Run(small, 1, 1, "burst", args.rounds),
        Run(small, 1, 3, "burst", args.rounds),
        Run(small, 3, 3, "burst", args.rounds),
        Run(large, 1, 3, "staggered", args.large_rounds, args.spread),
        Run(large, 3, 3, "staggered", args.large_rounds, args.spread),
    ]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=100, help="workers of the burst runs")
    p.add_argument("--large", type=int, default=1000, help="workers of the staggered runs")
    p.add_argument("--params", type=int, default=1_048_576, help="parameters per block")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the burst runs")
    p.add_argument("--large-rounds", type=int, default=2, help="rounds of the staggered runs")
    p.add_argument(
        "--spread", type=float, default=20.0, help="seconds over which staggered workers arrive"
    )
    p.add_argument("--quick", action="store_true", help="20 and 60 workers, 2 rounds")
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also run each configuration against REV's aggregator (git archive), interleaved",
    )
    p.add_argument("--no-write", action="store_true", help="print only; write no JSON or docs")
    p.add_argument(
        "--section-only",
        action="store_true",
        help="rewrite its sections (BENCHMARKS.md, docs/research/) from the JSON; no runs",
    )
    args = p.parse_args()
    if args.section_only:
        write_sections(json.loads((RESULTS / "protocol_load.json").read_text()))
        return
    if args.quick:
        args.workers, args.large, args.rounds, args.large_rounds, args.spread = 20, 60, 2, 1, 2.0
    torch.set_num_threads(1)
    results, baseline = [], []
    with tempfile.TemporaryDirectory() as tmp:
        old = export(args.baseline, Path(tmp)) if args.baseline else None
        new = this_checkout()
        for run in runs_of(args):
            if old is not None:  # A, B, A, B: the same noise for both
                baseline.append(attempt(run, args.params, old))
                print(row(baseline[-1]), flush=True)
            results.append(attempt(run, args.params, new))
            print(row(results[-1]), flush=True)
    first = results[0]
    result = {
        **{k: first[k] for k in ("workers", "params", "rounds", "wire_dtype", "body_bytes")},
        **{k: first[k] for k in ("push", "pull", "accepted", "refused", "refusal_reasons")},
        "final_version": first["final_versions"][0],
        "elapsed_s": first["elapsed_s"],
        "client": "bench/load_http.py (asyncio streams)",
        "commit": new.commit,
        "runs": results,
        **({"baseline": {"commit": old.commit, "runs": baseline}} if old is not None else {}),
        "machine": machine(),
    }
    if args.no_write:
        return
    path = write_json("protocol_load.json", result)
    print(f"wrote {path}")
    write_sections(result)


def write_sections(result: dict[str, Any]) -> None:
    """The table in BENCHMARKS.md; what the profile found, history, in docs/research/."""
    update_section("protocol-load", section(result))
    update_section("protocol-profile", profile_text(), RESEARCH / "decentralised.md")


if __name__ == "__main__":
    main()
