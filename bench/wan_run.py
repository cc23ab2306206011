"""A WAN-shaped training run: the aggregator and 3 worker hosts in their own network
namespaces (bench/netns.py builds them), each namespace's egress delayed 60 +- 20
ms (in order: a burst's packets near 80 ms), 1% of its packets dropped. Needs root. 2 workers
per host: 2 replicas of each of the tiny preset's 3 blocks, on two hosts (host h trains blocks
h and h+1 mod 3), so every average crosses the WAN. Round deadline 600 s: 6 trainers sharing 2
cores is not lateness. Recorded per round: the committed model's CE (evaluated after the run,
every version kept), participation, the aggregator's bytes by endpoint and host (its ledger,
read as each round closes); then each host's bytes from both ends, the test-split sampler CE,
and a single-process run of the same steps (-> benchmarks/results/wan_run.json, BENCHMARKS.md).

    sudo python bench/wan_run.py            # 12 rounds of H = 25: about 20 minutes here
    python bench/wan_run.py --report        # only the BENCHMARKS.md section, from the JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blocktrain.config import apply_overrides
from blocktrain.data import load_split, resolve_data_path
from blocktrain.errors import ProtocolError
from blocktrain.presets import preset
from blocktrain.protocol.ops.cluster import (
    Proc,
    start_aggregator,
    start_worker,
    stop,
    worker_report,
)
from blocktrain.protocol.store.state import bytes_summary, round_versions
from blocktrain.protocol.store.storage import StateDir
from blocktrain.training import EvalSettings, evaluate_blocktrain
from blocktrain.training.local import build_stack, write_assembled
from netns import Net, NetnsUnavailable, build_net, probe  # bench/netns.py
from protocol_cluster import run as blocktrain  # bench/protocol_cluster.py
from report import BENCHMARKS_MD, RESULTS, ROOT, cluster_state, machine, update_section

Counts = dict[str, int]
ZERO: Counts = {"requests": 0, "bytes_in": 0, "bytes_out": 0}  # and the order of a row's counts
HOST_SUMS = ("aggregator_bytes_in", "aggregator_push_bytes_in", "aggregator_bytes_out")
HOST_SUMS += ("workers_bytes_up", "workers_bytes_down")
PARTICIPATION = ("round", "accepted", "refused", "expected", "cause", "duration_s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=12, help="rounds per block")
    p.add_argument("--local-steps", type=int, default=25, help="H, local steps per round")
    p.add_argument("--hosts", type=int, default=3, help="worker host namespaces")
    p.add_argument("--workers-per-host", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=60.0, help="one-way delay per egress")
    p.add_argument("--jitter-ms", type=float, default=20.0, help="+- around --delay-ms")
    p.add_argument("--loss", type=float, default=0.01, help="share of packets dropped")
    p.add_argument("--deadline", type=float, default=600.0, help="round deadline, seconds")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--eval-bytes", type=int, default=8192, help="validation bytes per round")
    p.add_argument("--eval-sweeps", type=int, default=2, help="M of the per-round CE")
    p.add_argument("--final-bytes", type=int, default=32768, help="test bytes of the final CE")
    p.add_argument("--final-sweeps", type=int, default=16, help="M of the final CE")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after S seconds")
    p.add_argument("--work", default="runs/bench-wan", help="state, logs and models go here")
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    p.add_argument("--out", default=str(RESULTS / "wan_run.json"), help="the JSON")
    p.add_argument("--benchmarks", default=str(BENCHMARKS_MD), help="the Markdown to update")
    p.add_argument("--report", action="store_true", help="only rewrite the section from --out")
    args = p.parse_args()
    for name in ("rounds", "local_steps", "hosts", "workers_per_host", "deadline", "timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.jitter_ms <= args.delay_ms or not 0 <= args.loss < 1:
        p.error("need 0 <= --jitter-ms <= --delay-ms and 0 <= --loss < 1")
    return args


def traffic(ledger: Any) -> dict[str, list[int]]:
    """The aggregator's cumulative body bytes, "endpoint block worker" -> [requests, in, out]; the
    bench's own status polls left out."""
    return {
        f"{r['endpoint']} {r['block']} {r['worker_id']}": [r[k] for k in ZERO]
        for r in ledger.traffic()
        if r["endpoint"] != "status"
    }


def train(net: Net, args: argparse.Namespace, work: Path, data: str) -> dict[str, Any]:
    """The run itself; returns the raw measurements (the state folder stays in `work`)."""
    cfg = apply_overrides(preset(args.preset), [f"steps={args.rounds * args.local_steps}"])
    n = args.hosts * args.workers_per_host
    settings = {
        "deadline_s": args.deadline,
        "min_round_s": 0.0,  # a trusted run: a round closes as soon as its workers report
        "local_steps": args.local_steps,
        "n_workers": n,
        "keep_versions": 0,  # every version kept: the CE of each round is measured after
        "max_rounds": args.rounds,
    }
    state, tokens, observer = cluster_state(work / "state", cfg, settings, n)
    logs = work / "logs"
    procs: list[Proc] = []
    host_of: dict[str, int] = {}
    ledger = StateDir(state.root).ledger  # read from here: the files are shared
    t0 = time.monotonic()
    try:
        agg, url = start_aggregator(
            state, logs, host=net.agg_ip, extra=["--data", data], prefix=net.exec_prefix(net.agg)
        )
        procs.append(agg)
        for i, token in enumerate(tokens):
            h, k = divmod(i, args.workers_per_host)
            name = f"h{h + 1}-w{k}"
            host_of[name] = h
            procs.append(
                start_worker(
                    url,
                    token,
                    logs,
                    name=name,
                    data=data,
                    extra=["--block", str((h + k) % cfg.model.blocks)],
                    prefix=net.exec_prefix(net.hosts[h]),
                )
            )
        snapshots = [{"round": 0, "t_s": 0.0, "traffic": {}}]
        while True:
            closed = min(ledger.block_state(b)[1] for b in range(cfg.model.blocks))
            while closed >= len(snapshots) and len(snapshots) <= args.rounds:
                # the traffic rows are flushed by the aggregator's tick (every 0.1 s)
                now = {"t_s": time.monotonic() - t0, "traffic": traffic(ledger)}
                snapshots.append({"round": len(snapshots), **now})
                print(f"wan: round {len(snapshots) - 1} closed", file=sys.stderr, flush=True)
            if closed >= args.rounds:
                break
            if time.monotonic() - t0 > args.timeout:
                raise ProtocolError(f"the run did not finish within {args.timeout:.0f}s")
            for p in procs:
                if p.popen.poll() not in (None, 0):
                    raise ProtocolError(f"{p.name} exited: {p.stderr.read_text()[-500:]}")
            time.sleep(0.5)
        wall = time.monotonic() - t0
        for p in procs[1:]:  # they see `done` on their next poll and exit by themselves
            p.popen.wait(timeout=120)
        port = int(url.rsplit(":", 1)[1])
        report = probe(net, port, observer)
    finally:
        stop(procs[1:] + procs[:1])
    final_traffic = traffic(ledger)  # once the aggregator has flushed its counters at exit
    ledger.close()
    state.close()
    reports = {p.name: worker_report(p) or {} for p in procs[1:]}
    return {
        "cfg": cfg,
        "url": url,
        "host_ips": net.host_ips,
        "wall_s": wall,
        "status": report["status"],
        "connect_ms": [x * 1e3 for x in report["connect_s"]],
        "snapshots": snapshots,
        "final_traffic": final_traffic,
        "reports": reports,
        "host_of": host_of,
    }


def group(rows: dict[str, list[int]], name: Callable[[str, int], str]) -> dict[str, Counts]:
    """Sum traffic rows ("endpoint block worker" -> counts) by name(endpoint, worker)."""
    out: dict[str, Counts] = {}
    for key, (req, b_in, b_out) in rows.items():
        endpoint, _, worker = key.split()
        e = out.setdefault(name(endpoint, int(worker)), dict(ZERO))
        e["requests"] += req
        e["bytes_in"] += b_in
        e["bytes_out"] += b_out
    return out


def measure(run: dict[str, Any], args: argparse.Namespace, work: Path, data: str) -> dict:
    cfg, status, reports = run["cfg"], run["status"], run["reports"]
    host_of = {  # worker id -> its host's name; requests of no known worker: "unattributed"
        int(r["worker_id"]): f"h{run['host_of'][name] + 1}"
        for name, r in reports.items()
        if r.get("worker_id") is not None
    }

    def host(_: str, worker: int) -> str:
        return host_of.get(worker, "unattributed")

    state = StateDir(work / "state")
    valid = load_split(data, "valid").windows(cfg.model.seq_len, args.eval_bytes)
    rounds = []
    snaps = run["snapshots"]
    for r, chosen in enumerate(round_versions(state, args.rounds)):  # same bytes and noise
        blocks = {b: state.load_tensors(b, v) for b, v in chosen.items()}
        ev = evaluate_blocktrain(
            build_stack(cfg, blocks),
            valid,
            EvalSettings(sweeps=args.eval_sweeps, seed=cfg.seed, oracle=False),
        )
        row: dict[str, Any] = {"round": r, **{k: ev[k] for k in ("from_noise_ce", "sampler_ce")}}
        if r > 0:  # round r's traffic: from round r-1's close to round r's
            before = snaps[r - 1]["traffic"]
            moved = {k: [x - y for x, y in zip(v, before.get(k, [0, 0, 0]), strict=True)]
                     for k, v in snaps[r]["traffic"].items()}  # fmt: skip
            row["closed_at_s"] = snaps[r]["t_s"]
            row["blocks"] = {
                b: {k: rs[r - 1][k] for k in PARTICIPATION}
                for b, rs in status["participation"].items()
            }
            row["bytes_by_endpoint"] = group(moved, lambda ep, _: ep)
            row["bytes_by_host"] = group(moved, host)
        rounds.append(row)
    state.close()
    steps = args.rounds * args.local_steps
    write_assembled(work / "model", cfg, blocks, steps)  # the last round's
    single = work / "single"
    single_cmd = ["train", "--preset", args.preset, "--steps", str(steps), "--set", "threads=1"]
    blocktrain([*single_cmd, "--out", str(single), "--overwrite", "--no-progress", "--json"])
    eval_args = ["--split", "test", "--bytes", str(args.final_bytes), "--sweeps",
                 str(args.final_sweeps), "--seed", "0", "--json"]  # fmt: skip
    final = {
        "wan": blocktrain(["eval", str(work / "model"), *eval_args]),
        "single": blocktrain(["eval", str(single), *eval_args]),
    }
    end = run["final_traffic"]
    pushes = group({k: v for k, v in end.items() if k.startswith("push ")}, host)
    hosts: dict[str, Any] = {}
    for name, total in sorted(group(end, host).items()):
        mine = [w for w in reports if f"h{run['host_of'][w] + 1}" == name]
        hosts[name] = {
            "ip": run["host_ips"][int(name[1:]) - 1] if name != "unattributed" else None,
            "workers": mine,
            "aggregator_bytes_in": total["bytes_in"],
            "aggregator_push_bytes_in": pushes.get(name, {"bytes_in": 0})["bytes_in"],
            "aggregator_bytes_out": total["bytes_out"],
            "workers_bytes_up": sum(reports[w].get("bytes_up", 0) for w in mine),
            "workers_bytes_down": sum(reports[w].get("bytes_down", 0) for w in mine),
        }
    return {"rounds": rounds, "final": final, "hosts": hosts, "single_command": single_cmd}


def main() -> int:
    args = parse_args()
    if args.report:  # the section again from the JSON on disk, no run
        result = json.loads(Path(args.out).read_text())
        update_section("wan-run", markdown(result), Path(args.benchmarks))
        return 0
    data = str(resolve_data_path(args.data))
    work = ROOT / args.work
    if work.exists():
        sys.exit(f"{work} exists: remove it or pass another --work")
    try:
        net = build_net(
            hosts=args.hosts, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss=args.loss
        )
    except NetnsUnavailable as exc:
        print(f"wan: cannot build the namespaces: {exc}", file=sys.stderr)
        return 2
    try:
        run = train(net, args, work, data)
    finally:
        net.teardown()
    measured = measure(run, args, work, data)
    status = run["status"]
    status["bytes"]["by_endpoint"] = group(run["final_traffic"], lambda ep, _: ep)  # all in
    wire = {b["block"]: b["pull_bytes"] for b in status["blocks"]}
    pushed = {b["block"]: b["delta_bytes"] for b in status["blocks"]}
    result = {
        "command": " ".join(["python bench/wan_run.py", *sys.argv[1:]]),
        "impairment": net.impairment,
        **{k: getattr(args, k) for k in ("delay_ms", "jitter_ms", "loss", "preset", "hosts")},
        **{k: getattr(args, k) for k in ("workers_per_host", "rounds", "local_steps")},
        "deadline_s": args.deadline,
        "workers": args.hosts * args.workers_per_host,
        "steps_per_replica": args.rounds * args.local_steps,
        "aggregator": run["url"],
        "connect_ms": run["connect_ms"],
        "wall_s": run["wall_s"],
        "per_round_eval": {"split": "valid", "bytes": args.eval_bytes, "sweeps": args.eval_sweeps},
        "rounds_log": measured["rounds"],
        "updates": status["updates"],
        "bytes": bytes_summary(status, wire, pushed),
        "block_mb": max(wire.values()) / 1e6,
        "bytes_by_host": measured["hosts"],
        "final_eval": {"split": "test", "bytes": args.final_bytes, "sweeps": args.final_sweeps},
        "wan_sampler_ce": measured["final"]["wan"]["sampler_ce"],
        "single_sampler_ce": measured["final"]["single"]["sampler_ce"],
        "final": measured["final"],
        "single_command": "blocktrain " + " ".join(measured["single_command"]),
        "worker_reports": run["reports"],
        "machine": machine(),
    }
    path = Path(args.out)
    path.write_text(json.dumps(result, indent=2) + "\n")
    update_section("wan-run", markdown(result), Path(args.benchmarks))
    print(f"wan: CE {result['rounds_log'][0]['sampler_ce']:.3f} -> "
          f"{result['rounds_log'][-1]['sampler_ce']:.3f}; test sampler CE "
          f"{result['wan_sampler_ce']:.4f} (single {result['single_sampler_ce']:.4f}); "
          f"{result['bytes']['total'] / 1e6:.1f} MB; wrote {path}")  # fmt: skip
    return 0


def markdown(r: dict[str, Any]) -> str:
    rtt = sorted(r["connect_ms"])[len(r["connect_ms"]) // 2]
    log = r["rounds_log"]
    head = "| round | closed at | from-noise CE | sampler CE | accepted/expected | refused |"
    head += " pull MB | push MB | other KB |"
    rows = [head, "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for x in log:
        if x["round"] == 0:
            rows.append(
                f"| 0 (init) | | {x['from_noise_ce']:.3f} | {x['sampler_ce']:.3f} |" + " |" * 5
            )
            continue
        eps = x["bytes_by_endpoint"]
        acc = " ".join(f"{v['accepted']}/{v['expected']}" for v in x["blocks"].values())
        refused = sum(v["refused"] for v in x["blocks"].values())
        # a pull's body comes with it, or from the version's URL after a 303 ("weights")
        pull = sum(eps.get(ep, ZERO)["bytes_out"] for ep in ("pull", "weights", "delta"))
        push = eps.get("push", ZERO)["bytes_in"]
        other = sum(v["bytes_in"] + v["bytes_out"] for v in eps.values()) - pull - push
        rows.append(
            f"| {x['round']} | {x['closed_at_s']:.0f} s | {x['from_noise_ce']:.3f} | "
            f"{x['sampler_ce']:.3f} | {acc} | {refused} | {pull / 1e6:.2f} | {push / 1e6:.2f} | "
            f"{other / 1e3:.1f} |"
        )
    hosts = [
        "| host | workers (block) | aggregator: in (pushes) | workers: up | aggregator: out "
        "| workers: down |",
        "|---|---|---:|---:|---:|---:|",
    ]
    by_host = r["bytes_by_host"]
    total = {k: sum(h[k] for h in by_host.values()) for k in HOST_SUMS}
    for name, h in [*by_host.items(), ("all", {**total, "ip": None, "workers": []})]:
        blocks = ", ".join(f"{w} ({r['worker_reports'][w].get('block')})" for w in h["workers"])
        hosts.append(
            f"| {name} {h['ip'] or ''} | {blocks} | {h['aggregator_bytes_in']:,} "
            f"({h['aggregator_push_bytes_in']:,}) | {h['workers_bytes_up']:,} | "
            f"{h['aggregator_bytes_out']:,} | {h['workers_bytes_down']:,} |"
        )
    pushes_match = all(h[HOST_SUMS[1]] == h[HOST_SUMS[3]] for h in by_host.values())  # in, up
    out_gap = total["workers_bytes_down"] - total["aggregator_bytes_out"]
    out_match = (
        "match in the total"
        if not out_gap
        else f"differ in the total by {out_gap:+,} bytes, the workers' count less the ledger's "
        f"({out_gap / total['aggregator_bytes_out']:+.4%})"
    )
    eps = ["| endpoint | requests | bytes in | bytes out |", "|---|---:|---:|---:|"]
    for ep, v in sorted(r["bytes"]["by_endpoint"].items()):
        eps.append(f"| {ep} | {v['requests']} | {v['bytes_in']:,} | {v['bytes_out']:,} |")
    f = r["final"]
    return f"""
### A WAN-shaped training run: three hosts, {r["delay_ms"]:g} +- {r["jitter_ms"]:g} ms, {r["loss"]:.0%} loss

`{r["command"]}` (root; JSON: `benchmarks/results/wan_run.json`). The aggregator in one network
namespace, {r["hosts"]} worker hosts in others, {r["workers_per_host"]} workers each ({r["workers"]} in
all: 2 replicas of each of the {r["preset"]} preset's 3 blocks, a block's two replicas on two
different hosts). Impairment: {r["impairment"]}; a packet never overtakes the one ahead of it,
so within a burst the delay climbs toward its top. TCP connect from a worker host to the
aggregator: median {rtt:.0f} ms. {r["rounds"]} rounds of H = {r["local_steps"]} local steps
({r["steps_per_replica"]} per replica), fp16 on the wire, round deadline {r["deadline_s"]:g} s (generous on
purpose: 6 trainers share 2 cores here, and that is not what this run measures). Wall clock
{r["wall_s"]:.0f} s; {r["updates"]["accepted"]} updates accepted, {r["updates"]["refused"]} refused.

Per round: the CE of the model committed after it (nats/byte, {r["per_round_eval"]["bytes"]:,}
validation bytes, M = {r["per_round_eval"]["sweeps"]}, the same noise each round; evaluated after the run
from the state folder, which keeps every version), each block's accepted/expected replicas, and
the aggregator's body bytes between the previous round's close and this one's (read from its
ledger as each round closed; "other": registration, config, round polls, answers).

{chr(10).join(rows)}

Final quality on the test split ({r["final_eval"]["bytes"]:,} bytes, M = {r["final_eval"]["sweeps"]}, seed 0):
WAN run sampler CE **{f["wan"]["sampler_ce"]:.4f}** (from-noise {f["wan"]["from_noise_ce"]:.4f}), single-process
`{r["single_command"]}` **{f["single"]["sampler_ce"]:.4f}** (from-noise {f["single"]["from_noise_ce"]:.4f}),
the same steps per block.

Bytes by host, from both ends (HTTP bodies, status polls excluded): what the aggregator's
ledger counted for each host's workers, and what those workers counted themselves. The pushed
bytes {"match on every host" if pushes_match else "DO NOT match"}; the config answer and the
round polls carry no worker id (they show under "unattributed"), and the bytes out
{out_match}.

{chr(10).join(hosts)}

Bytes by endpoint at the aggregator, whole run: {r["bytes"]["total"] / 1e6:.1f} MB without the bench's
status polls, against a minimum of {r["bytes"]["minimum"] / 1e6:.1f} MB (one pull and one push of a
{r["block_mb"]:.2f} MB fp16 block per worker per round). The paper's three-host run moved
15.22 GB over 12 rounds (CE 5.58 -> 1.811) at its scale; this one {r["bytes"]["total"] / 1e6:.1f} MB over
{r["rounds"]} rounds (sampler CE {log[0]["sampler_ce"]:.2f} -> {log[-1]["sampler_ce"]:.3f} on the validation bytes above).

{chr(10).join(eps)}
"""


if __name__ == "__main__":
    sys.exit(main())
