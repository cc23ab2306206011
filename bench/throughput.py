"""Training throughput and model FLOP utilisation (MFU) of BlockTrain and the reference.

For each preset, in one run and interleaved (this machine is shared and noisy):
  - target bytes per second of the real training step (`Trainer.train_step`, data included);
  - model FLOPs per step, counted as the code runs (3 x forward matmul and attention FLOPs);
  - the machine's fp32 matmul rate on exactly the matrix shapes that step executes (forward and
    backward, same memory layouts), timed in isolation;
  - MFU = achieved model FLOP/s / that matmul rate.

    python bench/throughput.py                      # tiny and small, writes throughput.json
    python bench/throughput.py --presets small --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import load_split
from blocktrain.presets import preset
from blocktrain.runtime import keep_freed_memory
from blocktrain.training import Trainer
from blocktrain.training.flops import MatmulShape, count_flops
from report import (
    forward_flops,
    machine,
    update_section,
    write_json,
)  # bench/report.py, beside this script


def matmul_rate(shapes: list[MatmulShape], repeats: int = 3) -> float:
    """FLOP/s of torch's fp32 matmul on these shapes (each distinct shape timed, weighted by
    how often the step runs it)."""
    total_flops, total_time = 0, 0.0
    for shape, count in Counter(shapes).items():
        a = (
            torch.randn(shape.batch, shape.k, shape.m).transpose(1, 2)
            if shape.a_transposed
            else torch.randn(shape.batch, shape.m, shape.k)
        )
        b = (
            torch.randn(shape.batch, shape.n, shape.k).transpose(1, 2)
            if shape.b_transposed
            else torch.randn(shape.batch, shape.k, shape.n)
        )
        if shape.batch == 1:
            a, b = a[0], b[0]
        op = torch.bmm if a.dim() == 3 else torch.mm
        op(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            op(a, b)
            best = min(best, time.perf_counter() - t0)
        total_flops += shape.flops * count
        total_time += best * count
    return total_flops / total_time


def measure(cfg: RunConfig, kind: str, data: Path, steps: int, rounds: int) -> dict:
    train = load_split(data, "train")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer.create(cfg, Path(tmp) / "run", train, None, kind=kind)
        fwd = forward_flops(trainer, train)
        flops_per_step = 3 * fwd.total
        step_shapes = count_flops(trainer.train_step).matmuls  # forward and backward, one step
        for _ in range(2):
            trainer.train_step()  # warm up
        step_times, rates = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            step_times.append((time.perf_counter() - t0) / steps)
            rates.append(matmul_rate(step_shapes))
        mfus = [flops_per_step / t / r for t, r in zip(step_times, rates, strict=True)]
        step_s = statistics.median(step_times)
        bytes_per_step = cfg.train.batch_size * cfg.model.seq_len * len(trainer.units)
        return {
            "preset": cfg.preset,
            "model": kind,
            "target_bytes_per_s": bytes_per_step / step_s,
            "step_seconds": step_s,
            "updates_per_step": len(trainer.units),
            "train_flops_per_step": flops_per_step,
            "attention_flops_share": fwd.attention_flops / fwd.total,
            "achieved_gflops": flops_per_step / step_s / 1e9,
            "matmul_rate_gflops": statistics.median(rates) / 1e9,
            "mfu": statistics.median(mfus),
            "mfu_per_round": mfus,
            "config": cfg.to_dict(),
        }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--set", dest="overrides", nargs="+", default=[], help="config overrides")
    args = p.parse_args()
    keep_freed_memory()  # as the CLI does
    rows = []
    for name in args.presets.split(","):
        cfg = apply_overrides(preset(name), args.overrides)
        for kind in ("blocktrain", "reference"):
            row = measure(cfg, kind, args.data, args.steps, args.rounds)
            rows.append(row)
            print(
                f"{name:6s} {kind:10s} {row['target_bytes_per_s']:9.0f} B/s  "
                f"{row['achieved_gflops']:6.1f} GFLOP/s  matmul {row['matmul_rate_gflops']:6.1f}"
                f"  MFU {row['mfu']:.1%}",
                flush=True,
            )
    command = "python bench/throughput.py " + " ".join(sys.argv[1:])
    out = write_json(
        "throughput.json", {"command": command.strip(), "machine": machine(), "results": rows}
    )
    lines = [
        f"Command: `{command.strip()}` (writes `{out.relative_to(out.parents[2])}`)",
        "",
        "| preset | model | target bytes/s | model GFLOP/s | fp32 matmul GFLOP/s (same shapes) | MFU |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['model']} | {r['target_bytes_per_s']:,.0f} | "
            f"{r['achieved_gflops']:.1f} | {r['matmul_rate_gflops']:.1f} | "
            f"{r['mfu']:.1%} |"
        )
    update_section("throughput", "\n".join(lines))


if __name__ == "__main__":
    main()
