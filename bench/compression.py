"""Compressed deltas on the wire: the same run with every pushed delta in
fp16, int8 (a scale per row) and top-k at several ratios (error feedback on each worker).
Writes benchmarks/results/compression.json and the "compression" section of BENCHMARKS.md.

Each row is one `blocktrain.simulate` run (the protocol's own RoundEngine with its defaults:
validation, norm bound, effect probe, one vote per identity; real local training; a virtual
clock) of 6 workers at the tiny preset (2 replicas per block), regime lockstep, the same seed,
rounds and H in every row; only `delta_wire` differs, and with it the pulls: fp16 whole versions
for fp16, and deltas in the push codec from the view each worker holds for int8 and top-k (the
aggregator's default `pull_wire`; protocol/core/pulls.py). final_sampler_ce: the final model's sampler CE (M = 16 sweeps, 16384 validation
bytes); bytes_total: every pull and push body of the run (bytes_up: the pushes alone).

    python bench/compression.py                       # 4 rows of 10 rounds of H = 10
    python bench/compression.py --wires topk:0.01     # add a row (rows in the JSON are kept)
    python bench/compression.py --force               # re-run rows already in the JSON
    python bench/compression.py --wires fp16,int8 --seeds 0,1,2   # the spread between seeds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.presets import tiny
from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.simulate import SimSpec, simulate
from blocktrain.simulate.regimes import load_regime
from report import (
    RESULTS,
    add_simulated_row_args,  # bench/report.py  # bench/report.py
    machine,
    update_section,
    write_json,
)

NAME = "compression.json"
WIRES = ("fp16", "int8", "topk:0.1", "topk:0.03")
BAR = {"int8": (0.01, 0.55)}
"""What each codec must reach to be worth its loss, against fp16: (CE within, bytes at most);
int8 is held to the bar, top-k to the goal."""
GOAL = {"topk": (0.03, 0.1)}


def run_row(wire: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    # the run's seed draws the model's initial weights and each worker's batches
    cfg = apply_overrides(tiny(), [f"steps={args.rounds * args.local_steps}", f"seed={seed}"])
    spec = SimSpec(
        cfg,
        workers=6,
        rounds=args.rounds,
        protocol={"local_steps": args.local_steps, "delta_wire": wire},
        seed=seed,
        eval_every=args.rounds,  # the final model is what the table compares
    )
    t0 = time.perf_counter()
    report, _ = simulate(spec, [load_regime("lockstep")], args.train, args.valid)
    r = report["regimes"]["lockstep"]
    return {
        "wire": wire,
        "pull_wire": pull_wire(wire),
        "final_sampler_ce": r["final_sampler_ce"],
        "bytes_total": r["bytes"]["up"] + r["bytes"]["down"],
        "bytes_up": r["bytes"]["up"],
        "bytes_down": r["bytes"]["down"],
        "final_from_noise_ce": r["final_from_noise_ce"],
        "initial_ce": r["initial_ce"],
        "accepted": r["updates"]["accepted"],
        "refused": r["updates"]["refused"],
        "seed": report["seed"],
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "workers": 6,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_simulated_row_args(p)
    p.add_argument(
        "--wires",
        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
        default=list(WIRES),
        metavar="WIRES",
        help=f"comma-separated delta wires (default: {','.join(WIRES)})",
    )
    p.add_argument(
        "--seeds",
        type=lambda text: [int(x) for x in text.split(",") if x.strip()],
        default=[0],
        metavar="SEEDS",
        help="comma-separated seeds; the table is seed 0's, the others give the spread of "
        "each wire's CE against fp16 of the same seed (default: 0)",
    )
    args = p.parse_args()
    for wire in args.wires:
        try:
            DeltaWire.parse(wire)
        except ValueError as exc:
            p.error(str(exc))
    torch.set_num_threads(args.threads)
    args.train, args.valid = load_split(args.data, "train"), load_split(args.data, "valid")
    path = RESULTS / NAME
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    if path.exists():
        saved = json.loads(path.read_text())
        for r in [*saved["rows"], *saved.get("seed_rows", [])]:
            rows[(r["wire"], r["seed"])] = r
    for seed in args.seeds:
        for wire in args.wires:
            old = rows.get((wire, seed))
            if old is not None and not args.force and same_run(old, args):
                continue
            print(f"compression: {wire}, seed {seed} ...", file=sys.stderr, flush=True)
            rows[(wire, seed)] = run_row(wire, seed, args)
            result = result_of(rows)  # saved after every row: an interrupted run resumes
            write_json(NAME, result)
            update_section("compression", markdown(result))
    print(markdown(result_of(rows)))


def pull_wire(wire: str) -> str:
    """How the row's pulls travel: the aggregator's default for this push codec."""
    return AggregatorSettings(delta_wire=wire).pulls


def same_run(row: dict[str, Any], args: argparse.Namespace) -> bool:
    return (row["rounds"], row["local_steps"], row.get("pull_wire")) == (
        args.rounds,
        args.local_steps,
        pull_wire(row["wire"]),
    )


def result_of(rows: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """`rows`: seed 0's, each against fp16 of seed 0 (the table); `seed_rows`: the other seeds';
    `seeds`: per wire, its CE minus fp16's of the same seed, for every seed run with both."""
    first = {wire: r for (wire, seed), r in rows.items() if seed == 0}
    ordered = sorted(first.values(), key=lambda r: (r["wire"] not in WIRES, -r["bytes_up"]))
    base = first.get("fp16")
    for r in ordered:
        if base is None or r["rounds"] != base["rounds"]:
            r["ce_vs_fp16"] = r["bytes_vs_fp16"] = r["bytes_up_vs_fp16"] = None
            continue
        r["ce_vs_fp16"] = r["final_sampler_ce"] - base["final_sampler_ce"]
        r["bytes_vs_fp16"] = r["bytes_total"] / base["bytes_total"]
        r["bytes_up_vs_fp16"] = r["bytes_up"] / base["bytes_up"]
    seeds: dict[str, dict[str, Any]] = {}
    for (wire, seed), r in sorted(rows.items(), key=lambda kv: kv[0][1]):
        fp16 = rows.get(("fp16", seed))
        if wire == "fp16" or fp16 is None or fp16["rounds"] != r["rounds"]:
            continue
        entry = seeds.setdefault(wire, {"seeds": [], "ce_vs_fp16": [], "bytes_vs_fp16": []})
        entry["seeds"].append(seed)
        entry["ce_vs_fp16"].append(r["final_sampler_ce"] - fp16["final_sampler_ce"])
        entry["bytes_vs_fp16"].append(r["bytes_total"] / fp16["bytes_total"])
    for entry in seeds.values():
        ce = entry["ce_vs_fp16"]
        entry["ce_vs_fp16_mean"] = statistics.fmean(ce)
        entry["ce_vs_fp16_sd"] = statistics.stdev(ce) if len(ce) > 1 else None
    others = [r for (_, seed), r in sorted(rows.items(), key=lambda kv: kv[0][1]) if seed != 0]
    return {
        "command": "python bench/compression.py",
        "machine": machine(),
        "rows": ordered,
        "seed_rows": others,
        "seeds": seeds,
    }


def verdict(r: dict[str, Any]) -> str:
    """Bar (int8) or goal (top-k), on the total bytes and on the pushed bytes alone."""
    kind = r["wire"].split(":")[0]
    target = BAR.get(kind) or GOAL.get(kind)
    if target is None or r["ce_vs_fp16"] is None:
        return "—"
    ce_ok = r["ce_vs_fp16"] <= target[0]
    name = "bar" if kind in BAR else "goal"

    def met(ratio: float) -> str:
        return "met" if ce_ok and ratio <= target[1] else "not met"

    return (
        f"{name} (CE +{target[0]}, bytes ≤ {target[1]}): total {met(r['bytes_vs_fp16'])}, "
        f"pushes {met(r['bytes_up_vs_fp16'])}"
    )


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    first = rows[0] if rows else {"rounds": "?", "local_steps": "?", "seed": "?"}
    lines = [
        f"`{result['command']}`; JSON: `benchmarks/results/{NAME}`. 6 workers, preset tiny "
        f"(2 replicas per block), regime lockstep, {first['rounds']} rounds of H = "
        f"{first['local_steps']}, seed {first['seed']}, the aggregator's defaults; only the "
        "wire differs: pushes in the row's codec, pulls as fp16 whole versions (fp16) or as "
        "deltas in the push codec from the view each worker holds (int8, top-k). Final CE: the sampler CE "
        "(M = 16, 16384 validation bytes).",
        "",
        "| wire | pulls | final CE | − fp16 | bytes total | ÷ fp16 | bytes pushed | ÷ fp16 | "
        "accepted | refused | bar / goal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ce = "—" if r["ce_vs_fp16"] is None else f"{r['ce_vs_fp16']:+.4f}"
        total = "—" if r["bytes_vs_fp16"] is None else f"{r['bytes_vs_fp16']:.3f}"
        up = "—" if r["bytes_up_vs_fp16"] is None else f"{r['bytes_up_vs_fp16']:.3f}"
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "none"
        lines.append(
            f"| {r['wire']} | {r.get('pull_wire', 'fp16')} | {r['final_sampler_ce']:.4f} | {ce} | {r['bytes_total'] / 1e6:.1f} MB"
            f" | {total} | {r['bytes_up'] / 1e6:.1f} MB | {up} | {r['accepted']} | {refused} | "
            f"{verdict(r)} |"
        )
    spread = {w: e for w, e in result.get("seeds", {}).items() if len(e["seeds"]) > 1}
    if spread:
        lines += [
            "",
            "Seeds: each wire's final CE minus fp16's of the same seed (the same rounds; a "
            "difference smaller than the spread between seeds is no difference).",
            "",
            "| wire | seeds | CE − fp16, each seed | mean ± sd (± standard error) | "
            "bytes ÷ fp16, each seed |",
            "|---|---|---|---:|---|",
        ]
        for wire, e in spread.items():
            each = ", ".join(f"{x:+.4f}" for x in e["ce_vs_fp16"])
            ratios = ", ".join(f"{x:.3f}" for x in e["bytes_vs_fp16"])
            seeds = ", ".join(str(x) for x in e["seeds"])
            sem = e["ce_vs_fp16_sd"] / len(e["seeds"]) ** 0.5
            lines.append(
                f"| {wire} | {seeds} | {each} | {e['ce_vs_fp16_mean']:+.4f} ± "
                f"{e['ce_vs_fp16_sd']:.4f} (± {sem:.4f}) | {ratios} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
