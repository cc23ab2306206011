"""Where the aggregator's time goes, and what a change moved: N workers pushing in bursts to one
aggregator process run from a given source tree, with its CPU split into user and system time,
and optionally a py-spy profile of it summarised.

The workers pull the plain way (`GET /v1/blocks/{b}`, the body at once), which aggregators of
every version answer, so that an earlier commit can be measured the same way:

    git archive 17d5078 src | tar -x -C /tmp/before      # the source before the change
    python bench/protocol_profile.py --label before --src /tmp/before/src
    python bench/protocol_profile.py --label after                      # this checkout
    python bench/protocol_profile.py --label after --py-spy /tmp/venv/bin/py-spy --gil

Each label is a key of `benchmarks/results/protocol_profile.json`: its rounds' latencies, the
aggregator's CPU per update, and (with --py-spy) the functions holding most samples.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from blocktrain.protocol.core.bodies import CONTENT_TYPE, encode
from blocktrain.protocol.ops.cluster import stop
from load_http import Connection
from protocol_load import Run, cpu_seconds, phase, start_fleet, worker_deltas
from report import RESULTS, machine

IDLE = ("Condition.wait", "EpollSelector.select", "_PollLikeSelector", "Event.wait", "select (")


async def burst(url: str, tokens: list[str], rounds: int, params: int, log: dict) -> None:
    delta = worker_deltas(params, len(tokens), rounds)  # each its own: no push is a `copy`
    barrier = asyncio.Barrier(len(tokens))

    async def worker(i: int, token: str) -> None:
        conn = Connection(url)
        headers = {"Authorization": f"Bearer {token}"}
        r = await conn.request("POST", "/v1/workers", headers, b'{"block": 0}')
        headers["X-Worker-Id"] = str(json.loads(r.body)["worker_id"])
        last = -1
        for _ in range(rounds):
            while True:
                path = f"/v1/blocks/0/round?after={last}&wait=30"
                info = json.loads((await conn.request("GET", path, headers)).body)
                if info["round"] > last:
                    break
            last = info["round"]
            await barrier.wait()
            t0 = time.perf_counter()
            pulled = await conn.request("GET", "/v1/blocks/0", headers)
            t1 = time.perf_counter()
            meta = {"block": 0, "base_version": int(pulled.headers["x-version"]), "round": last}
            body = encode(delta(i, last), {**meta, "tokens": 4096}, "fp16")
            await barrier.wait()
            t2 = time.perf_counter()
            pushed = await conn.request(
                "POST",
                "/v1/blocks/0/updates",
                {**headers, "Content-Type": CONTENT_TYPE},
                body,
            )
            t3 = time.perf_counter()
            log["pull"].append(((0, last), t0, t1, len(pulled.body)))
            log["push"].append(((0, last), t2, t3, len(body), pushed.status, ""))
        await conn.close()

    await asyncio.gather(*(worker(i, t) for i, t in enumerate(tokens)))


def summarise(raw: Path, top: int = 15) -> dict[str, list[tuple[str, float]]]:
    """The functions holding the most samples of busy threads (py-spy's raw format)."""
    own: collections.Counter[str] = collections.Counter()
    within: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or frames[-1].startswith(IDLE):
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            within[frame] += n
    share = 100.0 / max(1, total)
    return {
        "self_percent": [(f, round(n * share, 1)) for f, n in own.most_common(top)],
        "blocktrain_inclusive_percent": [
            (f, round(n * share, 1))
            for f, n in within.most_common(200)
            if "blocktrain/" in f and "cli/" not in f
        ][:top],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--label", required=True, help="the key in protocol_profile.json")
    p.add_argument("--src", help="run the aggregator from this source tree (default: this one)")
    p.add_argument("--workers", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--params", type=int, default=1_048_576)
    p.add_argument("--py-spy", metavar="PATH", help="profile the aggregator with this py-spy")
    p.add_argument("--gil", action="store_true", help="py-spy: only the thread holding the GIL")
    args = p.parse_args()
    if args.src:  # the aggregator subprocess imports blocktrain from there
        os.environ["PYTHONPATH"] = str(Path(args.src).resolve())
    run = Run(args.workers, 1, 1, "burst", args.rounds)
    log: dict[str, list] = {"pull": [], "push": []}
    with tempfile.TemporaryDirectory() as tmp:
        fleet = start_fleet(Path(tmp), run, args.params)
        pid = fleet.procs[0].popen.pid
        raw = Path(tmp) / "profile.txt"
        spy = None
        if args.py_spy:
            cmd = [args.py_spy, "record", "-r", "100", "-f", "raw", "-o", str(raw), "--pid"]
            spy = subprocess.Popen([*cmd, str(pid), *(["--gil"] if args.gil else [])])
            time.sleep(1.0)
        stat0 = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu0 = cpu_seconds(pid)
        started = time.perf_counter()
        try:
            asyncio.run(burst(fleet.url_of_block[0], fleet.tokens, run.rounds, args.params, log))
        finally:
            elapsed = time.perf_counter() - started
            stat1 = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = cpu_seconds(pid) - cpu0
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait()
            stop(fleet.procs)
            for state in fleet.states:
                state.close()
        profile = summarise(raw) if spy is not None and raw.exists() else None
    updates = sum(1 for e in log["push"] if e[4] == 200)
    tick = os.sysconf("SC_CLK_TCK")
    result: dict[str, Any] = {
        "source": args.src or "this checkout",
        "workers": args.workers,
        "rounds": args.rounds,
        "accepted": updates,
        "push": phase(log["push"]),
        "pull": phase(log["pull"]),
        "aggregator_cpu_ms_per_update": 1e3 * cpu / max(1, updates),
        "aggregator_user_ms_per_update": 1e3
        * (int(stat1[11]) - int(stat0[11]))
        / tick
        / max(1, updates),
        "aggregator_system_ms_per_update": 1e3
        * (int(stat1[12]) - int(stat0[12]))
        / tick
        / max(1, updates),
        "elapsed_s": elapsed,
        "py_spy": None if profile is None else {"gil": args.gil, **profile},
        "machine": machine(),
    }
    path = RESULTS / "protocol_profile.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[args.label] = result
    path.write_text(json.dumps(doc, indent=2) + "\n")
    push = result["push"]
    print(
        f"{args.label}: push p50 {push['p50_ms']:.0f} ms, p99 {push['p99_ms']:.0f} ms; aggregator "
        f"{result['aggregator_cpu_ms_per_update']:.1f} ms CPU per update "
        f"({result['aggregator_user_ms_per_update']:.1f} user, "
        f"{result['aggregator_system_ms_per_update']:.1f} system); wrote {path}"
    )


if __name__ == "__main__":
    main()
