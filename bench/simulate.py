"""The asynchronous simulator's regimes side by side (DESIGN.md 5 and 7.5).

    1. blocktrain simulate --preset tiny --workers 6 --rounds 30 --regime lockstep,mild,wan
       (real local training; one process; virtual time)
    2. the same regimes with --timing-only over 10 seeds: how far one run's realised
       participation scatters around the regime's mean

Writes benchmarks/results/simulate.json, benchmarks/results/simulate.png (CE against rounds and
against virtual time) and the `simulate` section of BENCHMARKS.md.

    python bench/simulate.py                  # about 15 minutes on 2 shared cores
    python bench/simulate.py --threads 2
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from typing import Any

from report import (  # bench/report.py
    RESULTS,
    ROOT,
    blocktrain_json,
    machine,
    update_section,
    write_json,
)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--regime", default="lockstep,mild,wan")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the simulation")
    p.add_argument("--seeds", type=int, default=10, help="seeds of the timing-only sweep")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the training run's seed (default: the preset's); another seed writes "
        "simulate_seedN.json/.png and its own section",
    )
    args = p.parse_args()
    common = ["--preset", args.preset, "--workers", str(args.workers)]
    common += ["--rounds", str(args.rounds), "--regime", args.regime, "--no-progress"]
    name = "simulate" if args.seed is None else f"simulate_seed{args.seed}"
    out = ROOT / "benchmarks" / "work" / name  # records and weights, kept out of git
    shutil.rmtree(out, ignore_errors=True)
    argv = ["simulate", *common, "--threads", str(args.threads), "--json"]
    if args.seed is not None:
        argv += ["--seed", str(args.seed)]
    report = blocktrain_json([*argv, "--out", str(out)])
    RESULTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "ce.png", RESULTS / f"{name}.png")
    spread: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        timing = blocktrain_json(
            ["simulate", *common, "--timing-only", "--seed", str(seed), "--json"]
        )
        for regime, r in timing["regimes"].items():
            spread.setdefault(regime, []).append(r["participation"])
    report.pop("outputs", None)
    command = "python bench/simulate.py " + " ".join(sys.argv[1:])
    wall = sum(r["compute"]["wall_s"] for r in report["regimes"].values())
    train = sum(r["compute"]["train_s"] for r in report["regimes"].values())
    result = {
        "command": command.strip(),
        "machine": machine(),
        "simulate_argv": argv,
        "train_fraction": train / wall,
        "participation_over_seeds": {
            name: {"mean": statistics.mean(v), "stdev": statistics.stdev(v), "runs": v}
            for name, v in spread.items()
        },
        **report,
    }
    write_json(f"{name}.json", result)
    update_section(name.replace("_", "-"), markdown(result, name))
    print(markdown(result, name))


def markdown(result: dict[str, Any], name: str = "simulate") -> str:
    regimes = result["regimes"]
    rows = [
        f"`{result['command']}` ({result['workers']} workers, preset "
        f"{result['config']['preset']}, {result['rounds']} rounds of H = "
        f"{result['protocol']['local_steps']}, one process; per-round CE: one sweep from noise "
        f"on {result['eval']['bytes']} validation bytes). Plot: "
        f"[benchmarks/results/{name}.png](benchmarks/results/{name}.png).",
        "",
        "| regime | deadline (virtual s) | participation (this run) | participation, "
        f"{len(next(iter(result['participation_over_seeds'].values()))['runs'])} seeds "
        "(timing only) | initial CE | final CE | final − lockstep | final sampler CE "
        f"(M = {result['eval']['final_sweeps']}, {result['eval']['final_bytes']} bytes) | "
        "sampler − lockstep | virtual time (s) | "
        "refused | dropped | training share of wall time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    lock = regimes.get("lockstep", {}).get("final_ce")
    lock_sampler = regimes.get("lockstep", {}).get("final_sampler_ce")
    for name, r in regimes.items():
        seeds = result["participation_over_seeds"][name]
        refused = ", ".join(f"{k} {v}" for k, v in r["updates"]["refused"].items()) or "none"
        diff = "—" if lock is None else f"{r['final_ce'] - lock:+.3f}"
        sdiff = "—" if lock_sampler is None else f"{r['final_sampler_ce'] - lock_sampler:+.3f}"
        rows.append(
            f"| {name} | {r['deadline_s']:.2f} | {r['participation']:.1%} | "
            f"{seeds['mean']:.1%} ± {seeds['stdev']:.1%} | {r['initial_ce']:.3f} | "
            f"{r['final_ce']:.3f} | {diff} | {r['final_sampler_ce']:.3f} | {sdiff} | "
            f"{r['virtual_time_s']:.0f} | {refused} | "
            f"{r['updates']['dropped']} | {r['compute']['train_fraction']:.1%} |"
        )
    rows += [
        "",
        f"Training compute took {result['train_fraction']:.1%} of the simulation's wall time "
        "over all regimes (the rest: per-round evaluation, safetensors encoding, validation, "
        "aggregation and the event loop).",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
