"""The `paper` preset (3 blocks of 4 layers, d = 768, T = 512, bf16) and its 12-layer end-to-end
reference, side by side on one GPU, at the same number of steps.

It calibrates BlockTrain's step time, picks the step count that fills --budget seconds of
BlockTrain training, trains both models for that many steps (the reference is cheaper per step,
so it finishes sooner), then records for each: test CE (BlockTrain's sampler CE over M sweeps),
training throughput in bytes/s and model FLOP/s, and peak GPU memory. bench/gpu_quality.sh runs it
on the device machine inside 8 minutes; on a CPU it runs with --preset tiny for a smoke test.

    python bench/gpu_quality.py                           # on a GPU: the paper preset
    python bench/gpu_quality.py --preset tiny --device cpu --steps 50 --test-bytes 4096
    python bench/gpu_quality.py --report                  # BENCHMARKS.md from the committed JSON
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import ByteSource, load_split
from blocktrain.presets import preset
from blocktrain.training import EvalSettings, Trainer, evaluate_blocktrain, evaluate_reference
from report import (  # bench/report.py
    BENCHMARKS_MD,
    RESULTS,
    machine,
    train_flops_per_step,
    update_section,
)

JSON_NAME = "gpu_quality.json"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(trainer: Trainer, n: int) -> None:
    """`n` updates of every unit, without the checkpoints `Trainer.run` writes (a paper-shape
    checkpoint is over a GiB, and nothing here resumes)."""
    for _ in range(n):
        trainer.train_step()
        trainer.step += 1


def seconds_per_step(cfg: RunConfig, kind: str, train: ByteSource, work: Path) -> float:
    """Warm: 3 steps to settle kernels and the allocator, then 10 timed."""
    trainer = Trainer.create(cfg, work / f"calibrate-{kind}", train, None, kind=kind)
    train_steps(trainer, 3)
    synchronize(trainer.device)
    started = time.perf_counter()
    train_steps(trainer, 10)
    synchronize(trainer.device)
    return (time.perf_counter() - started) / 10


def train_and_measure(
    cfg: RunConfig, kind: str, data: dict[str, ByteSource], work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    trainer = Trainer.create(cfg, work / kind, data["train"], None, kind=kind)
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    started = time.perf_counter()
    train_steps(trainer, cfg.train.steps)
    synchronize(device)
    train_seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    step_flops = train_flops_per_step(trainer, data["train"])
    windows = data["test"].windows(cfg.model.seq_len, args.test_bytes)
    settings = EvalSettings(sweeps=args.sweeps, seed=1234, batch_size=args.eval_batch)
    for unit in trainer.units:
        unit.module.eval()
    with trainer.autocast():
        if trainer.stack is not None:
            test = evaluate_blocktrain(trainer.stack, windows, settings)
            ce = test["sampler_ce"]
        else:
            assert trainer.reference is not None
            test = evaluate_reference(trainer.reference, windows, settings)
            ce = test["ce"]
    print(f"[{kind}] {trainer.step} steps in {train_seconds:.0f} s; test CE {ce:.4f}", flush=True)
    return {
        "steps": trainer.step,
        "train_seconds": train_seconds,
        "bytes_per_second": trainer.bytes_seen / train_seconds,  # all blocks' batches
        "train_flops_per_step": step_flops,
        "model_flops_per_second": step_flops * trainer.step / train_seconds,
        "peak_gpu_memory_bytes": peak,
        "test_ce": ce,
        "test": test,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = {split: load_split(args.data, split) for split in ("train", "test")}
    base = apply_overrides(
        preset(args.preset),
        [f"device={args.device}", "eval_every=0", "checkpoint_every=1000000", *args.set],
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        calibrate = apply_overrides(base, ["steps=1000"])
        step_s = seconds_per_step(calibrate, "blocktrain", data["train"], work)
        steps = args.steps if args.steps is not None else max(20, int(args.budget / step_s))
        warmup = max(1, min(base.train.warmup_steps, steps // 10))
        cfg = apply_overrides(base, [f"steps={steps}", f"warmup_steps={warmup}"])
        print(f"BlockTrain {step_s:.3f} s/step: {steps} steps each, warmup {warmup}", flush=True)
        runs = {
            kind: train_and_measure(cfg, kind, data, work, args)
            for kind in ("blocktrain", "reference")
        }
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    return {
        "command": "bash bench/gpu_quality.sh",
        "machine": {**machine(), "gpu": gpu},
        "config": cfg.to_dict(),
        "sweeps": args.sweeps,
        "test_bytes": args.test_bytes,
        "runs": runs,
        "gap": runs["blocktrain"]["test_ce"] - runs["reference"]["test_ce"],
    }


def table(result: dict[str, Any]) -> str:
    gib = 1024**3
    cfg = result["config"]
    m = cfg["model"]
    lines = [
        f"Command: `{result['command']}` on {result['machine']['gpu'] or result['machine']['cpu']}"
        f" (torch {result['machine']['torch']}, commit {result['machine']['commit']}).",
        "",
        f"Preset `{cfg['preset']}`: d = {m['d_model']}, {m['layers']} layers in {m['blocks']} "
        f"blocks, T = {m['seq_len']}, batch {cfg['train']['batch_size']}, "
        f"{cfg['train']['precision']}; the same {result['runs']['blocktrain']['steps']} steps "
        f"each; test CE on {result['test_bytes']:,} bytes (BlockTrain: sampler CE, "
        f"M = {result['sweeps']}).",
        "",
        "| model | test CE | train s | bytes/s | model TFLOP/s | peak GPU memory GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, r in result["runs"].items():
        peak = r["peak_gpu_memory_bytes"]
        lines.append(
            f"| {kind} | {r['test_ce']:.4f} | {r['train_seconds']:.0f} | "
            f"{r['bytes_per_second']:,.0f} | {r['model_flops_per_second'] / 1e12:.1f} | "
            f"{'-' if peak is None else f'{peak / gib:.2f}'} |"
        )
    lines += ["", f"Gap (BlockTrain - reference): {result['gap']:+.4f} nats/byte."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="paper")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=150.0, help="BlockTrain training seconds")
    p.add_argument(
        "--steps", type=int, help="train this many steps each instead of filling --budget"
    )
    p.add_argument("--test-bytes", type=int, default=131072)
    p.add_argument("--sweeps", type=int, default=8, help="M for BlockTrain's sampler CE")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where gpu_quality.json goes")
    p.add_argument(
        "--benchmarks",
        type=Path,
        default=BENCHMARKS_MD,
        help="the BENCHMARKS.md whose gpu-quality section a GPU run or --report rewrites",
    )
    p.add_argument("--report", action="store_true", help="only rewrite BENCHMARKS.md's section")
    args = p.parse_args()
    path = args.out / JSON_NAME
    if not args.report:
        if args.device == "cuda" and not torch.cuda.is_available():
            p.error("no CUDA device here; run on the device machine or pass --device cpu")
        result = run(args)
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", flush=True)
        if args.device == "cpu":
            return  # a smoke test: BENCHMARKS.md shows GPU runs only
    update_section("gpu-quality", table(json.loads(path.read_text())), args.benchmarks)


if __name__ == "__main__":
    main()
