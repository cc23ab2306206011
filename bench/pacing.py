"""Adaptive pacing against a fixed deadline (issue 30, docs/protocol.md, Pacing).

The tiny preset in the simulator, with real local training: W workers, one of them --slowdown
times slower than the rest, R rounds of H local steps, a deadline of --deadline-factor times a
normal worker's round (so that a normal worker fits and the slow one does not), once with
`--set pacing=fixed` and once with `--set pacing=adaptive`, side by side in one process: the same seed,
regime, rounds and protocol otherwise (its defaults, the effect probe included). Per run: the
updates accepted and refused (by reason) of the slow worker and of the others, the steps they
ran, the final model's test CE (the sampler CE over M sweeps on the test bytes) and the virtual
seconds the rounds took.

Writes benchmarks/results/pacing.json and the "Adaptive pacing" section of BENCHMARKS.md.

    python bench/pacing.py                   # 6 workers, 20 rounds of H = 25
    python bench/pacing.py --smoke           # 2 rounds of H = 3, few bytes: that it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split, resolve_data_path
from blocktrain.presets import preset
from blocktrain.simulate import Dist, Regime, SimSpec, simulate
from blocktrain.training import EvalSettings, evaluate_blocktrain
from blocktrain.training.local import build_stack
from report import BENCHMARKS_MD, machine, update_section, write_json

RESULT = "pacing.json"
PACINGS = ("fixed", "adaptive")


def regime(deadline_factor: float) -> Regime:
    """Steady workers (a step's time drawn per round around 0.5 s, sigma 0.1), short latencies,
    no dropout; the deadline `deadline_factor` times a normal worker's round."""
    return Regime(
        "pacing",
        step_s=Dist.lognormal(0.5, 0.1),
        latency_s=Dist.lognormal(0.05, 0.3),
        bandwidth_MBps=Dist.const(100.0),
        deadline=deadline_factor,
        description="steady workers, one of them slower; a deadline a normal worker fits",
    )


def tally(workers: list[dict[str, Any]]) -> dict[str, Any]:
    refused: Counter[str] = Counter()
    for w in workers:
        refused.update(w["refused"])
    return {
        "workers": len(workers),
        "accepted": sum(w["accepted"] for w in workers),
        "refused": dict(sorted(refused.items())),
        "local_steps": sum(w["local_steps"] for w in workers),
    }


def run(args: argparse.Namespace, data: Path, pacing: str) -> dict[str, Any]:
    cfg = preset(args.preset)
    cfg = apply_overrides(
        cfg, [f"steps={args.rounds * args.local_steps}", f"seed={args.seed}", "eval_every=0"]
    )
    if args.threads:
        cfg = apply_overrides(cfg, [f"threads={args.threads}"])
    protocol = {"local_steps": args.local_steps, "pacing": pacing}
    spec = SimSpec(
        cfg,
        args.workers,
        args.rounds,
        protocol,
        seed=args.seed,
        eval_bytes=args.eval_bytes,
        eval_every=args.rounds,  # the per-round CE is not reported: evaluate the last round only
        final_sweeps=args.sweeps,
        final_bytes=args.eval_bytes,
        slowdown={args.slow_worker: args.slowdown},
    )
    print(f"simulating pacing = {pacing}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    report, weights = simulate(
        spec, [regime(args.deadline_factor)], load_split(data, "train"), load_split(data, "valid")
    )
    result = report["regimes"]["pacing"]
    test = load_split(data, "test").windows(cfg.model.seq_len, args.bytes)
    stack = build_stack(cfg, weights["pacing"])
    test_ce = float(
        evaluate_blocktrain(stack, test, EvalSettings(sweeps=args.sweeps, seed=0))["sampler_ce"]
    )
    workers = result["workers"]
    slow = [w for w in workers if w["worker_id"] == args.slow_worker]
    others = [w for w in workers if w["worker_id"] != args.slow_worker]
    out = {
        "pacing": pacing,
        "deadline_s": result["deadline_s"],
        "virtual_time_s": result["virtual_time_s"],
        "participation": result["participation"],
        "updates": result["updates"],
        "slow": {**tally(slow), "block": slow[0]["block"], "speed": slow[0]["speed"]},
        "others": tally(others),
        "initial_ce": result["initial_ce"],
        "final_valid_ce": result["final_ce"],
        "final_valid_sampler_ce": result["final_sampler_ce"],
        "test_ce": test_ce,
        "protocol": report["protocol"],
        "rounds": result["rounds"],
        "workers": workers,
        "wall_s": time.perf_counter() - started,
    }
    print(
        f"  {pacing}: slow worker {out['slow']['accepted']} accepted, refused "
        f"{out['slow']['refused']}; others {out['others']['accepted']} accepted; test CE "
        f"{test_ce:.4f}; {out['virtual_time_s']:.0f} virtual s",
        file=sys.stderr,
        flush=True,
    )
    return out


def refusals(refused: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in refused.items()) or "none"


def markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    first = runs[0]
    h, rounds = result["local_steps"], result["rounds"]
    lines = [
        f"`{result['command']}`: the {result['preset']} preset in the simulator (real local "
        f"training, one process), {result['workers']} workers, worker {result['slow_worker']} "
        f"{result['slowdown']:g}x slower than the rest, {rounds} rounds of H = {h}, seed "
        f"{result['seed']}, the same regime for both runs (a step ~0.5 s, a deadline of "
        f"{first['deadline_s']:.1f} virtual s: {result['deadline_factor']:g}x a normal worker's "
        f"round), the protocol's defaults otherwise (effect probe on, pacing margin "
        f"{first['protocol']['pacing_margin']:g}). Test CE: the final model's sampler CE "
        f"(M = {result['sweeps']}) on {result['test_bytes']} test bytes.",
        "",
        "| pacing | slow worker: accepted | slow worker: refused | slow worker: steps run | "
        "others: accepted | others: refused | all accepted | test CE | virtual time (s) |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in runs:
        slow, others = r["slow"], r["others"]
        lines.append(
            f"| {r['pacing']} | {slow['accepted']} of {rounds} | {refusals(slow['refused'])} | "
            f"{slow['local_steps']} of {rounds * h} | {others['accepted']} of "
            f"{rounds * others['workers']} | {refusals(others['refused'])} | "
            f"{r['updates']['accepted']} | {r['test_ce']:.4f} | {r['virtual_time_s']:.0f} |"
        )
    by = {r["pacing"]: r for r in runs}
    if set(PACINGS) <= set(by):
        fixed, adaptive = by["fixed"], by["adaptive"]
        lines += [
            "",
            f"Adaptive pacing: {adaptive['slow']['accepted'] - fixed['slow']['accepted']:+d} "
            "accepted updates from the slow worker, test CE "
            f"{adaptive['test_ce'] - fixed['test_ce']:+.4f} against the fixed deadline, "
            f"virtual time {adaptive['virtual_time_s'] - fixed['virtual_time_s']:+.0f} s.",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=25, help="H")
    p.add_argument("--slow-worker", type=int, default=5, help="the slow worker's id")
    p.add_argument("--slowdown", type=float, default=3.0, help="how much slower it is")
    p.add_argument(
        "--deadline-factor",
        type=float,
        default=1.5,
        help="the deadline as a multiple of a normal worker's round",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweeps", type=int, default=16, help="M of the sampler CE")
    p.add_argument("--bytes", type=int, default=32768, help="test bytes")
    p.add_argument("--eval-bytes", type=int, default=4096, help="validation bytes (final CE)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    p.add_argument("--out", type=Path, help="the JSON (default: benchmarks/results/pacing.json)")
    p.add_argument("--benchmarks", type=Path, default=BENCHMARKS_MD, help="the markdown file")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="2 rounds of H = 3, 2 sweeps, few bytes: that the bench runs (writes its results "
        "like a full run)",
    )
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.local_steps, args.sweeps = 2, 3, 2
        args.bytes, args.eval_bytes = 1024, 512
    if args.threads:
        torch.set_num_threads(args.threads)
    data = resolve_data_path(args.data)
    runs = [run(args, data, pacing) for pacing in PACINGS]
    result = {
        "command": ("python bench/pacing.py " + " ".join(sys.argv[1:])).strip(),
        "machine": machine(),
        "preset": args.preset,
        "workers": args.workers,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "slow_worker": args.slow_worker,
        "slowdown": args.slowdown,
        "deadline_factor": args.deadline_factor,
        "seed": args.seed,
        "sweeps": args.sweeps,
        "test_bytes": args.bytes,
        "runs": runs,
    }
    if args.out is None:
        write_json(RESULT, result)
    else:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    update_section("pacing", markdown(result), args.benchmarks)
    print(markdown(result))


if __name__ == "__main__":
    main()
