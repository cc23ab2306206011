"""What a worker holds and does, by route (training/costs.py, the figures of `blocktrain plan`):
no training, everything on the meta device, so it runs in about a minute.

(a) memory: `plan --shape layers=32,d=4096,blocks=B` for B in 4, 8, 16, 32 and the routes state,
    features and relay: the largest worker's training memory (activations not counted) and its
    ratio to state's;
(b) compute: `plan --shape layers=36,d=4096,blocks=6`: the largest worker's FLOPs per local
    step by route and the ratio to state's;
(c) a projection on the consumer-gpu profile (an 8 GB RTX 4060 on a home link) at a ~1B and a
    ~7B shape: for each route and for DiLoCo's end-to-end replica (the whole reference per
    worker, pulled and pushed whole each round), whether a worker fits in 8 GB, its round of H
    local steps, and the time to train on 1e9 target bytes with one worker per block (W = B;
    DiLoCo with as many replicas), each worker's step taking batch x T target bytes:
    rounds = 1e9 / (W x H x batch x T), time = rounds x the slowest worker's round.

Writes benchmarks/results/worker_costs.json and the "worker-costs" section of BENCHMARKS.md.

    python bench/worker_costs.py
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from blocktrain.config import apply_overrides
from blocktrain.relaystream import BYTES_PER_TOKEN_OVER_D
from blocktrain.serving.host.shapes import count_params, parse_shape, shape_run
from blocktrain.training.costs import cost_plan, reference_cost
from blocktrain.training.profiles import PROFILES
from report import blocktrain_json, machine, update_section, write_json

NAME = "worker_costs.json"
ROUTES = ("state", "features", "relay")
MEMORY_SHAPE = "layers=32,d=4096"
MEMORY_BLOCKS = (4, 8, 16, 32)
FLOPS_SHAPE = "layers=36,d=4096,blocks=6"
PROJECTIONS = {"~1B": "layers=20,d=2048,blocks=4", "~7B": "layers=32,d=4096,blocks=16"}
PROFILE = "consumer-gpu"
TARGET_BYTES = 1e9
GIB = 1024**3


def plan(spec: str) -> dict[str, Any]:
    """`blocktrain plan --shape SPEC --json` (its default profile and H)."""
    return blocktrain_json(["plan", "--shape", spec, "--json"])


def memory_rows() -> list[dict[str, Any]]:
    rows = []
    for blocks in MEMORY_BLOCKS:
        largest = {}
        for route in ROUTES:
            result = plan(f"{MEMORY_SHAPE},blocks={blocks},route={route}")
            largest[route] = result["worker_training_bytes"]["total"]
            assert largest[route] == max(r["memory_bytes"] for r in result["per_block"])
        rows.append(
            {
                "shape": f"{MEMORY_SHAPE},blocks={blocks}",
                "blocks": blocks,
                "params_total": result["params_total"],
                "largest_worker_bytes": largest,
                "of_state": {r: largest[r] / largest["state"] for r in ROUTES},
            }
        )
    return rows


def flops_row() -> dict[str, Any]:
    largest = {}
    for route in ROUTES:
        result = plan(f"{FLOPS_SHAPE},route={route}")
        largest[route] = max(r["flops_per_step"] for r in result["per_block"])
    return {
        "shape": FLOPS_SHAPE,
        "batch_size": result["batch_size"],
        "largest_worker_flops_per_step": largest,
        "of_state": {r: largest[r] / largest["state"] for r in ROUTES},
    }


def projection(label: str, spec: str, local_steps: int) -> dict[str, Any]:
    profile = PROFILES[PROFILE]
    _, model = parse_shape(spec)
    per_block, reference = count_params(model)
    rows = []
    for route in (*ROUTES, "diloco"):
        cfg = shape_run(model)
        if route == "diloco":
            cost = reference_cost(cfg, local_steps=local_steps)
            fits, round_s, memory = cost.fits(profile), cost.round_s(profile), cost.memory_bytes
            step_s, slowest = cost.step_s(profile), None
            flops = cost.flops_per_step
            round_bytes = cost.bytes_per_round["total"]
        else:
            cfg = apply_overrides(cfg, [f"route={route}"])
            result = cost_plan(cfg, profile, local_steps=local_steps)
            slowest = result["slowest_block"]
            worst = result["per_block"][slowest]
            fits, round_s = result["fits"], worst["round_s"]
            memory, step_s = result["largest_worker_bytes"], worst["step_s"]
            flops = max(r["flops_per_step"] for r in result["per_block"])
            round_bytes = max(r["bytes_per_round"]["total"] for r in result["per_block"])
        workers = model.blocks
        per_round = workers * local_steps * cfg.train.batch_size * model.seq_len
        rounds = TARGET_BYTES / per_round
        rows.append(
            {
                "route": route,
                "fits": fits,
                "largest_worker_bytes": memory,
                "largest_worker_flops_per_step": flops,
                "slowest_block": slowest,
                "step_s": step_s,
                "round_s": round_s,
                "largest_bytes_per_round": round_bytes,
                "workers": workers,
                "target_bytes_per_round": per_round,
                "rounds": rounds,
                "hours_for_target": rounds * round_s / 3600,
            }
        )
    return {
        "label": label,
        "shape": spec,
        "seq_len": model.seq_len,
        "batch_size": shape_run(model).train.batch_size,
        "params_total": per_block * model.blocks,
        "params_per_block": per_block,
        "reference_params": reference,
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    prof = result["profile"]
    lines = [
        f"Command: `{result['command']}` (writes `benchmarks/results/{NAME}`). Everything is "
        "counted by this code on the meta device (`training/costs.py`, the figures of "
        "`blocktrain plan --shape SPEC --json`): memory without activations, FLOPs of one local "
        f"step at batch {result['flops']['batch_size']} x T = 1024 bytes.",
        "",
        f"**Memory** of the largest worker, `plan --shape {MEMORY_SHAPE},blocks=B` (GiB; ratio "
        "to state):",
        "",
        "| B | params | state | features | relay |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["memory"]:
        m, of = r["largest_worker_bytes"], r["of_state"]
        lines.append(
            f"| {r['blocks']} | {r['params_total'] / 1e9:.2f}B | {m['state'] / GIB:.2f} | "
            f"{m['features'] / GIB:.2f} ({of['features']:.2f}x) | "
            f"{m['relay'] / GIB:.2f} ({of['relay']:.2f}x) |"
        )
    f = result["flops"]
    fl, of = f["largest_worker_flops_per_step"], f["of_state"]
    lines += [
        "",
        f"**Compute** of the largest worker, `plan --shape {FLOPS_SHAPE}`: TFLOP per local "
        f"step, state {fl['state'] / 1e12:.1f}, features {fl['features'] / 1e12:.1f} "
        f"({of['features']:.2f}x: the last block also runs the clean streams of the "
        f"{parse_shape(FLOPS_SHAPE)[1].blocks - 1} before it), relay {fl['relay'] / 1e12:.1f} "
        f"({of['relay']:.2f}x).",
        "",
        f"**Projection** on `{prof['name']}` ({prof['description']}: "
        f"{prof['peak_flops_per_s'] / 1e12:.2f} TFLOP/s BF16 peak x {prof['utilisation']} "
        f"assumed utilisation, {prof['memory_bytes'] / GIB:.0f} GiB, "
        f"{prof['link_down_bytes_per_s'] * 8 / 1e6:.1f}/{prof['link_up_bytes_per_s'] * 8 / 1e6:.1f} "
        f"Mb/s, {prof['latency_s']} s latency; sources in `training/profiles.py`), H = "
        f"{result['local_steps']} local steps a round, fp16 on the wire, one worker per block "
        "(DiLoCo: as many replicas of the whole reference); hours to train on 1e9 target bytes "
        "= 1e9 / (workers x H x batch x T) rounds x the slowest worker's round:",
        "",
        "| shape | route | workers | fits 8 GiB | largest worker GiB | step s | round s | "
        "MB a round (largest) | hours for 1e9 bytes |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in result["projection"]:
        head = (
            f"{p['label']}: `{p['shape']}` ({p['params_total'] / 1e9:.2f}B; reference "
            f"{p['reference_params'] / 1e9:.2f}B)"
        )
        for r in p["rows"]:
            lines.append(
                f"| {head} | {r['route']} | {r['workers']} | {'yes' if r['fits'] else 'no'} | "
                f"{r['largest_worker_bytes'] / GIB:.2f} | {r['step_s']:.2f} | "
                f"{r['round_s']:.0f} | {r['largest_bytes_per_round'] / 1e6:,.0f} | "
                f"{r['hours_for_target']:.1f} |"
            )
            head = ""
    relay = [r["of_state"]["relay"] for r in result["memory"]]
    features = [r["of_state"]["features"] for r in result["memory"]]
    shares = [
        1 - result["local_steps"] * r["step_s"] / r["round_s"]
        for p in result["projection"]
        for r in p["rows"]
    ]
    lines += [
        "",
        "What it says: under `features` the last worker holds the clean streams of every block "
        f"before it, so its memory grows with B while its own block shrinks ({min(features):.2f}x "
        f"to {max(features):.2f}x state's); under `relay` it holds one step of the relayed "
        f"streams instead ({min(relay):.2f}x to {max(relay):.2f}x: the stream per step is fixed "
        "while the block shrinks). On a home link the transfers and latencies take "
        f"{min(shares):.0%} to {max(shares):.0%} of a round in these rows. Relay's round "
        "against features': "
        + "; ".join(
            f"{p['label']} {rounds['relay']:.0f} s against {rounds['features']:.0f} s"
            for p in result["projection"]
            for rounds in [{r["route"]: r["round_s"] for r in p["rows"]}]
        )
        + " (the relayed stream, H x batch x T x (d + "
        f"{BYTES_PER_TOKEN_OVER_D}) bytes each way a round, grows with d; "
        "the upstream blocks that features pulls whole grow with d^2 and with B). These are "
        "projections "
        "from counted FLOPs and bytes under the profile's sourced and assumed figures, not "
        "measurements on a GPU.",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--local-steps", type=int, default=10, help="H for the projection's rounds")
    args = p.parse_args()
    if args.local_steps <= 0:
        p.error("--local-steps must be positive")
    memory = memory_rows()
    flops = flops_row()
    projections = [projection(k, v, args.local_steps) for k, v in PROJECTIONS.items()]
    result = {
        "command": " ".join(["python bench/worker_costs.py", *sys.argv[1:]]),
        "machine": machine(),
        "profile": PROFILES[PROFILE].to_dict(),
        "local_steps": args.local_steps,
        "target_bytes": TARGET_BYTES,
        "memory": memory,
        "flops": flops,
        "projection": projections,
    }
    write_json(NAME, result)
    update_section("worker-costs", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
