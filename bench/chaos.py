"""Chaos soak: a decentralised run of the tiny preset in network namespaces (the
aggregator in one, the workers in two worker hosts; bench/netns.py builds them)
with, throughout `--minutes`:

- SIGKILLs of the aggregator (restarted on the same state folder and port) and of workers
  (restarted with their token);
- delay, loss and partition toggles on a worker host's links (iptables, and an NFQUEUE delay
  program where the kernel lacks sch_netem);
- slowloris clients (half-sent headers and bodies) and oversized bodies (bench/chaos_clients.py).

Afterwards it checks: the ledger is consistent (SQLite's integrity check, rounds contiguous,
each round's base version the previous round's new version); versions are monotonic per block
(in the ledger and in every /v1/status sampled during the run, across restarts); every accepted
update is in exactly one committed version (that of the round it counted in) or in the open
round; the aggregator's peak RSS (VmRSS, sampled every second) stays under `--rss-bound-mb`;
and the final sampler CE is within noise of an undisturbed run (loopback, no chaos) of the same
number of rounds, same seed and workers. "Within noise": |CE_chaos - CE_clean| <= max(0.05,
3 x the spread of each model's CE over `--eval-seeds` evaluation seeds); 0.05 is the CE change
tolerated from an attack. Writes benchmarks/results/chaos.json. Needs root and iproute2.

    python bench/chaos.py                        # 20 minutes, 6 workers
    python bench/chaos.py --minutes 3 --workers 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from blocktrain.data import resolve_data_path
from blocktrain.presets import preset
from blocktrain.protocol.ops.cluster import run_cluster
from blocktrain.protocol.store.storage import StateDir
from chaos_checks import check_ledger, sampled_monotonic, sampler_ce  # bench/chaos_checks.py
from chaos_soak import DELAY_QUEUE, Soak, make_state  # bench/chaos_soak.py
from netns import DELAY_PROGRAM, NetnsUnavailable, build_net  # bench/netns.py
from report import machine, write_json  # bench/report.py


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=20.0, help="length of the soak")
    p.add_argument("--workers", type=int, default=6, help="worker processes (2 per block: 6)")
    p.add_argument("--deadline", type=float, default=20.0, help="round deadline, seconds")
    p.add_argument("--local-steps", type=int, default=5, help="local steps per round")
    p.add_argument("--rss-bound-mb", type=float, default=1024.0, help="the aggregator's RSS bound")
    p.add_argument("--oversized-mb", type=int, default=300, help="size of the oversized bodies")
    p.add_argument(
        "--fault-every",
        type=float,
        nargs=2,
        default=(5.0, 15.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults, drawn uniformly",
    )
    p.add_argument("--eval-bytes", type=int, default=8192)
    p.add_argument("--eval-seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seeds the faults")
    p.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    p.add_argument(
        "--out", default="chaos.json", help="file under benchmarks/results, or an absolute path"
    )
    args = p.parse_args()
    if args.minutes <= 0 or args.workers <= 0:
        p.error("--minutes and --workers must be positive")
    try:
        net = build_net(impaired=False)
    except NetnsUnavailable as exc:
        print(f"chaos: cannot build the namespaces: {exc}", file=sys.stderr)
        return 2
    helpers = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for ns in net.hosts:  # the delay program, idle until a toggle queues packets to it
                helpers.append(
                    subprocess.Popen(
                        [
                            *net.exec_prefix(ns),
                            sys.executable,
                            str(DELAY_PROGRAM),
                            "--queue",
                            str(DELAY_QUEUE),
                            "--delay-ms",
                            "100",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            net.helpers.extend(helpers)
            state, tokens, observer = make_state(Path(tmp) / "chaos" / "state", args, None)
            soak = Soak(net, state, tokens, args)
            try:
                hostile = soak.run(observer)
            finally:
                soak.stop()
            state = StateDir(state.root)
            ledger = check_ledger(state)
            rounds = min(state.ledger.block_state(b)[1] for b in range(state.n_blocks()))
            chaos_ce = sampler_ce(
                state, preset("tiny"), rounds, args.data, args.eval_bytes, args.eval_seeds
            )
            clean_state, clean_tokens, clean_observer = make_state(
                Path(tmp) / "clean" / "state", args, rounds
            )
            t0 = time.monotonic()
            run_cluster(
                clean_state,
                clean_tokens,
                clean_observer,
                Path(tmp) / "clean" / "logs",
                data=str(resolve_data_path(args.data)),
                timeout_s=args.minutes * 120 + 600,
            )
            clean_seconds = time.monotonic() - t0
            clean_ce = sampler_ce(
                StateDir(clean_state.root),
                preset("tiny"),
                rounds,
                args.data,
                args.eval_bytes,
                args.eval_seeds,
            )
        finally:
            net.teardown()
    spread = max(statistics.pstdev(chaos_ce), statistics.pstdev(clean_ce))
    tolerance = max(0.05, 3 * spread)
    gap = abs(statistics.mean(chaos_ce) - statistics.mean(clean_ce))
    checks = {
        "ledger_consistent": ledger["consistent"],
        "versions_monotonic": ledger["versions_monotonic"]
        and sampled_monotonic(soak.status_versions),
        "rss_under_bound": soak.peak_rss_kb / 1024 < args.rss_bound_mb,
        "ce_within_noise": gap <= tolerance,
        "rounds_closed": rounds > 0,
        # the servers' head and body-rate timeouts (httpserve.Limits) close every slowloris
        # connection within the clients' 40 s; vacuous without a hostile batch, so it fails then
        "slowloris_closed": bool(hostile) and all(h.get("still_open") == 0 for h in hostile),
        "oversized_refused": bool(hostile)
        and all(
            not str(outcome).startswith("HTTP/1.1 2")
            for h in hostile
            for outcome in h.get("oversized", {}).values()
        ),
    }
    faults: dict[str, int] = {}
    for e in soak.events:
        key = e["event"] if e["event"] != "sigkill" else f"sigkill_{e['target'].split('-')[0]}"
        faults[key] = faults.get(key, 0) + 1
    result = {
        "command": "python bench/chaos.py " + " ".join(sys.argv[1:]),
        "minutes": args.minutes,
        "workers": args.workers,
        "preset": "tiny",
        "deadline_s": args.deadline,
        "local_steps": args.local_steps,
        "seed": args.seed,
        "checks": checks,
        "passed": all(checks.values()),
        "faults": faults,
        "process_starts": soak.starts,
        "rounds_compared": rounds,
        "aggregator_peak_rss_mb": round(soak.peak_rss_kb / 1024, 1),
        "aggregator_rss_mb_every_10s": soak.rss_mb,
        "rss_bound_mb": args.rss_bound_mb,
        "ce": {
            "chaos": chaos_ce,
            "clean": clean_ce,
            "gap": gap,
            "tolerance": tolerance,
            "rule": "|mean chaos - mean clean| <= max(0.05, 3 x the larger std over eval seeds)",
            "eval_bytes": args.eval_bytes,
            "eval_seeds": args.eval_seeds,
            "sweeps": 4,
        },
        "clean_run_seconds": round(clean_seconds, 1),
        "ledger": ledger,
        "status_samples": len(soak.status_versions),
        "hostile_clients": hostile,
        "events": soak.events,
        "machine": machine(),
    }
    write_json(args.out, result)
    print(
        json.dumps(
            {
                "checks": checks,
                "faults": faults,
                "rounds": rounds,
                "peak_rss_mb": result["aggregator_peak_rss_mb"],
                "ce": result["ce"],
            }
        )
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
