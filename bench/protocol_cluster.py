"""Decentralised training over HTTP on this machine against single-process training at the same
number of worker steps (DESIGN.md 7.6).

    1. blocktrain cluster --workers N --preset P --rounds R --local-steps H   (N/B replicas per block)
    2. blocktrain train --preset P --steps R*H                                (one process, all blocks)
    3. blocktrain eval on both, same held-out bytes, sweeps and seed

Every replica takes R*H AdamW steps, as does each block of the single-process run; the cluster
averages N/B replicas per block each round, so it spends N/B times the compute. Writes
benchmarks/results/protocol_cluster.json and the `protocol-cluster` section of BENCHMARKS.md.

    python bench/protocol_cluster.py                         # 6 workers, tiny, 30 rounds of 10
    python bench/protocol_cluster.py --skip-run              # re-read runs/bench-cluster, -single
"""

from __future__ import annotations

import argparse
import itertools
import json

from report import (
    ROOT,
    blocktrain,
    blocktrain_json,
    machine,
    update_section,
    write_json,
)  # bench/report.py


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--cluster-dir", default="runs/bench-cluster")
    p.add_argument("--single-dir", default="runs/bench-single")
    p.add_argument("--skip-run", action="store_true", help="only evaluate existing runs")
    args = p.parse_args()
    steps = args.rounds * args.local_steps
    cluster_cmd = [
        "cluster",
        "--workers",
        str(args.workers),
        "--preset",
        args.preset,
        "--rounds",
        str(args.rounds),
        "--local-steps",
        str(args.local_steps),
        "--out",
        args.cluster_dir,
    ]
    # one torch thread, as each worker has: on a shared machine two OpenMP threads per process
    # stall each other far more than they help
    single_cmd = [
        "train",
        "--preset",
        args.preset,
        "--steps",
        str(steps),
        "--set",
        "threads=1",
        "--out",
        args.single_dir,
    ]
    if not args.skip_run:
        blocktrain([*cluster_cmd, "--overwrite", "--no-progress", "--json"])
        blocktrain([*single_cmd, "--overwrite", "--no-progress", "--json"])
    summary = json.loads((ROOT / args.cluster_dir / "summary.json").read_text())
    eval_cmd = [
        "eval",
        "--split",
        "valid",
        "--bytes",
        "32768",
        "--sweeps",
        "16",
        "--seed",
        "0",
        "--json",
    ]
    cluster_eval = blocktrain_json([eval_cmd[0], f"{args.cluster_dir}/model", *eval_cmd[1:]])
    single_eval = blocktrain_json([eval_cmd[0], args.single_dir, *eval_cmd[1:]])
    single_state = json.loads((ROOT / args.single_dir / "state.json").read_text())
    b = summary["bytes"]
    ce = summary["from_noise_ce_per_round"]
    result = {
        "workers": args.workers,
        "preset": args.preset,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "steps_per_replica": steps,
        "replicas_per_block": summary["replicas_per_block"],
        "cluster_wall_s": summary["wall_seconds"],
        "single_wall_s": single_state.get("wall_seconds"),
        "from_noise_ce_per_round": ce,
        "sampler_ce_per_round": summary["sampler_ce_per_round"],
        "per_round_eval": summary["per_round_eval"],
        "participation_mean": summary["participation_mean"],
        "updates": summary["updates"],
        "bytes": b,
        "params_per_block": summary["params_per_block"],
        "cluster_eval": cluster_eval,
        "single_eval": single_eval,
        "commands": {
            "cluster": "blocktrain " + " ".join(cluster_cmd),
            "single": "blocktrain " + " ".join(single_cmd),
            "eval": "blocktrain eval RUN " + " ".join(eval_cmd[1:]),
        },
        "machine": machine(),
    }
    write_json("protocol_cluster.json", result)
    falls = sum(1 for a, c in itertools.pairwise(ce) if c < a)
    shown = [0, 1, 2, 5, 10, 15, 20, 25, args.rounds]
    ce_rows = " | ".join(f"{r}" for r in shown if r < len(ce))
    ce_vals = " | ".join(f"{ce[r]:.3f}" for r in shown if r < len(ce))
    part = summary["participation_mean"]
    causes: dict[str, int] = {}
    for rounds in summary["participation"].values():
        for r in rounds:
            causes[r["cause"]] = causes.get(r["cause"], 0) + 1
    wire = summary["params_per_block"] * 2
    update_section(
        "protocol-cluster",
        f"""
### Decentralised training over HTTP: `cluster` against single-process training

Commands (`python bench/protocol_cluster.py`, writes `benchmarks/results/protocol_cluster.json`):

    {result["commands"]["cluster"]}
    {result["commands"]["single"]}
    {result["commands"]["eval"]}        # for RUN = {args.cluster_dir}/model and {args.single_dir}

{args.workers} worker processes and the aggregator on this machine, real HTTP on loopback:
{summary["replicas_per_block"][0]} replicas per block (the seed's shared-node run), {args.rounds} rounds of
H = {args.local_steps} local AdamW steps, fp16 on the wire, token-weighted mean. Each replica
takes {steps} steps, as does each block of the single-process run (which therefore spends
1/{summary["replicas_per_block"][0]} of the cluster's compute). Rounds closed early (all replicas in): {causes.get("all_reported", 0)},
at the deadline: {causes.get("deadline", 0)}; participation per block: {", ".join(f"{v:.2f}" for v in part.values())};
{summary["updates"]["accepted"]} updates accepted, {summary["updates"]["refused"]} refused. Wall clock: cluster
{summary["wall_seconds"]:.0f} s (6 processes on 2 shared cores), single process {single_state.get("wall_seconds", 0):.0f} s.

From-noise CE (nats/byte, {summary["per_round_eval"]["bytes"]} validation bytes, M = {summary["per_round_eval"]["sweeps"]}) of the model
committed after each round. It fell in {falls} of {len(ce) - 1} rounds, from {ce[0]:.3f} (the initialisation) to its
lowest, {min(ce):.3f}, after round {ce.index(min(ce))}; it ends at {ce[-1]:.3f}, the later rounds moving by a few hundredths
while the learning rate decays to its floor:

| round | {ce_rows} |
|---|{"---|" * len([r for r in shown if r < len(ce)])}
| from-noise CE | {ce_vals} |

Final quality, `blocktrain eval` on the same 32,768 validation bytes, M = 16, seed 0:

| run | worker steps per block replica | sampler CE | from-noise CE | CE per step |
|---|---:|---:|---:|---|
| cluster, {args.workers} workers over HTTP | {steps} | {cluster_eval["sampler_ce"]:.4f} | {cluster_eval["from_noise_ce"]:.4f} | {", ".join(f"{v:.3f}" for v in cluster_eval["ce_per_step"])} |
| single process | {steps} | {single_eval["sampler_ce"]:.4f} | {single_eval["from_noise_ce"]:.4f} | {", ".join(f"{v:.3f}" for v in single_eval["ce_per_step"])} |

Bytes moved (HTTP bodies; the orchestrator's status polls excluded): {b["total"] / 1e6:.1f} MB
({b["down"] / 1e6:.1f} MB down, {b["up"] / 1e6:.1f} MB up) against a minimum of {b["minimum"] / 1e6:.1f} MB = one
weights download and one delta upload of {wire / 1e6:.3f} MB (fp16, {summary["params_per_block"]:,} parameters)
per worker per round, {b["worker_rounds"]} worker-rounds: {b["ratio_to_minimum"]:.4f}x the minimum (the rest is
JSON: registration, config, round polls, answers).
""",
    )


if __name__ == "__main__":
    main()
