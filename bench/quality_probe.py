"""Probe: can the later blocks add more? The tiny preset with different sigma ranges, training
lengths and sampler settings, every model measured on the same test bytes.

    OMP_NUM_THREADS=1 python bench/quality_probe.py                      # the sigma sweep, 600 steps
    OMP_NUM_THREADS=1 python bench/quality_probe.py --runs s1-10,s0.5-10 --samplers
    OMP_NUM_THREADS=1 python bench/quality_probe.py --runs s1-10@1500,s0.5-10@1500

A run is `TAG[@STEPS]`; TAG names a sigma range (`s{min}-{max}`); --seed N (default 0) trains
with another seed (folder and key get a `-seedN` suffix). Each run folder
lives under --work (default benchmarks/work/probe/TAG-STEPS); a finished training is not repeated,
an interrupted one resumes from its checkpoint, and every evaluation is cached in the run folder
as eval-M{M}-spb{S}-{sampler}.json. All results go to benchmarks/results/quality_probe.json.
Evaluation: --test-bytes of the test split (the same windows for every model), seed 1234.
`--reuse TAG@STEPS=DIR` copies the weights of an already trained run folder with the same model
config and step count instead of training (e.g. the quality bench's converged-blocktrain, which
ran the full 1500 steps); its wall seconds are the source's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import load_split
from blocktrain.model import BlockStack
from blocktrain.presets import preset
from blocktrain.training import EvalSettings, Trainer, evaluate_blocktrain, load_model
from report import RESEARCH, ROOT, machine, update_section, write_json  # bench/report.py

SECTION_MD = RESEARCH / "quality.md"  # superseded by the full-mode run of BENCHMARKS.md

EVAL_SEED = 1234


def config(tag: str, steps: int, seed: int = 0) -> RunConfig:
    """`s{min}-{max}` -> the tiny preset with sigma in [min, max], trained `steps` steps."""
    lo, hi = tag.removeprefix("s").split("-")
    cfg = apply_overrides(
        preset("tiny"),
        [f"sigma_min={lo}", f"sigma_max={hi}", f"steps={steps}", "threads=1", f"seed={seed}"],
    )
    # like bench/quality.py: the probe evaluates by itself, the trainer only checkpoints
    return apply_overrides(cfg, ["eval_every=0", "log_every=50"])


def parse_run(spec: str, default_steps: int) -> tuple[str, int]:
    tag, _, steps = spec.partition("@")
    return tag, int(steps) if steps else default_steps


def train(cfg: RunConfig, run_dir: Path, data: str | None) -> dict[str, Any]:
    done = run_dir / "probe_train.json"
    if done.exists():
        return dict(json.loads(done.read_text()))
    train_split = load_split(data, "train")
    if (run_dir / "state.json").exists():
        trainer = Trainer.resume(run_dir, train_split, None)
        if trainer.cfg != cfg:
            raise SystemExit(f"{run_dir} holds a different config; move it away")
    else:
        trainer = Trainer.create(cfg, run_dir, train_split, None, overwrite=True)
    print(f"[{run_dir.name}] training from step {trainer.step} to {cfg.train.steps}", flush=True)
    trainer.run(progress=False)
    out = {"steps": trainer.step, "wall_seconds": trainer.wall_seconds}
    done.write_text(json.dumps(out))
    return out


def evaluate(
    run_dir: Path, windows: torch.Tensor, sweeps: int, spb: int, sampler: str
) -> dict[str, Any]:
    path = run_dir / f"eval-M{sweeps}-spb{spb}-{sampler}.json"
    if path.exists():
        cached = dict(json.loads(path.read_text()))
        if "sampler_ce_by_sweeps" in cached:  # older evaluations lack it: measure again
            return cached
    _, stack = load_model(run_dir)
    settings = EvalSettings(sweeps=sweeps, steps_per_block=spb, seed=EVAL_SEED, sampler=sampler)
    started = time.perf_counter()
    assert isinstance(stack, BlockStack)
    result = evaluate_blocktrain(stack, windows, settings)
    result["eval_seconds"] = time.perf_counter() - started
    path.write_text(json.dumps(result, indent=2))
    print(
        f"[{run_dir.name}] M={sweeps} spb={spb} {sampler}: sampler {result['sampler_ce']:.4f} "
        f"from-noise {result['from_noise_ce']:.4f} oracle {result['oracle_ce']:.4f} "
        f"per step {', '.join(f'{v:.3f}' for v in result['ce_per_step'])} "
        f"mixture per step {', '.join(f'{v:.3f}' for v in result['sampler_ce_per_step'])} "
        f"({result['eval_seconds']:.0f} s)",
        flush=True,
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", default="s1-10,s0.5-10,s0.25-10", help="TAG[@STEPS],...")
    p.add_argument("--steps", type=int, default=600, help="steps of a run without @STEPS")
    p.add_argument("--sweeps", default="16,64", help="M values of the base evaluation")
    p.add_argument(
        "--samplers",
        action="store_true",
        help="also steps_per_block 1, 2, 4 x euler, ancestral at M = --sampler-sweeps (M = 16 "
        "also from the first 16 sweeps: sampler_ce_by_sweeps)",
    )
    p.add_argument("--sampler-sweeps", type=int, default=64)
    p.add_argument("--combos", default="", help="more evaluations: M:STEPS_PER_BLOCK:SAMPLER,...")
    p.add_argument("--test-bytes", type=int, default=16384)
    p.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    p.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "probe")
    p.add_argument("--reuse", action="append", default=[], help="TAG@STEPS=RUN_DIR")
    p.add_argument("--train-only", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="training seed (table, init, batches)")
    p.add_argument(
        "--report", action="store_true", help="only rewrite its table (SECTION_MD) from the JSON"
    )
    args = p.parse_args()
    out_path = ROOT / "benchmarks" / "results" / "quality_probe.json"
    if args.report:
        update_section("quality-probe", table(json.loads(out_path.read_text())), SECTION_MD)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    reuse = {}
    for item in args.reuse:
        key, _, folder = item.partition("=")
        reuse[parse_run(key, args.steps)] = Path(folder)
    test = load_split(args.data, "test")
    windows = test.windows(preset("tiny").model.seq_len, args.test_bytes)
    previous = json.loads(out_path.read_text()) if out_path.exists() else {}
    results: dict[str, Any] = previous.get("runs", {})
    command = "python bench/quality_probe.py " + " ".join(sys.argv[1:])
    commands = [c for c in previous.get("commands", [previous.get("command")]) if c]
    commands += [] if command in commands else [command]
    sweeps = [int(m) for m in args.sweeps.split(",")]
    combos = [(m, 1, "euler") for m in sweeps]
    if args.samplers:
        combos += [
            (m, spb, method)
            for method in ("euler", "ancestral")
            for spb in (1, 2, 4)
            for m in (args.sampler_sweeps,)
            if (m, spb, method) not in combos
        ]
    for item in filter(None, args.combos.split(",")):
        m_text, spb_text, method = item.split(":")
        combos.append((int(m_text), int(spb_text), method))
    for spec in args.runs.split(","):
        tag, steps = parse_run(spec, args.steps)
        cfg = config(tag, steps, args.seed)
        seed_suffix = f"-seed{args.seed}" if args.seed else ""
        key = f"{tag}@{steps}{seed_suffix}"
        run_dir = args.work / f"{tag}-{steps}{seed_suffix}"
        if (tag, steps) in reuse and not (run_dir / "probe_train.json").exists():
            source = reuse[(tag, steps)]
            info, _ = load_model(source)
            state = json.loads((source / "state.json").read_text())
            if (
                info.config.model != cfg.model
                or state["step"] != steps
                or info.config.train.steps != steps
            ):
                raise SystemExit(f"{source} is not {key}")
            run_dir.mkdir(parents=True, exist_ok=True)
            for name in ("config.json", "state.json", "model.safetensors"):
                shutil.copy2(source / name, run_dir / name)
            reused = {
                "steps": steps,
                "wall_seconds": state["wall_seconds"],
                "reused_from": str(source),
            }
            (run_dir / "probe_train.json").write_text(json.dumps(reused))
        trained = train(cfg, run_dir, args.data)
        if args.train_only:
            continue
        entry = results.setdefault(key, {})
        entry["sigma"] = [cfg.model.sigma_min, cfg.model.sigma_max]
        entry["train"] = trained
        entry.setdefault("evals", {})
        for m, spb, method in combos:
            r = evaluate(run_dir, windows, m, spb, method)
            entry["evals"][f"M{m}-spb{spb}-{method}"] = {
                k: r[k]
                for k in (
                    "sampler_ce",
                    "from_noise_ce",
                    "oracle_ce",
                    "oracle_ce_per_block",
                    "ce_per_step",
                    "sampler_ce_per_step",
                    "sampler_ce_by_sweeps",
                    "bytes",
                    "eval_seconds",
                )
            }
        doc = {
            "commands": commands,
            "eval": {"test_bytes": args.test_bytes, "seed": EVAL_SEED, "split": "test"},
            "machine": machine(),
            "runs": results,
        }
        write_json("quality_probe.json", doc)
        update_section("quality-probe", table(doc), SECTION_MD)


def table(doc: dict[str, Any]) -> str:
    """Every evaluation of every run, one row each (CE in nats/byte on the test bytes)."""
    rows = [
        "Commands (run in this order; results accumulate in "
        "`benchmarks/results/quality_probe.json`): "
        + "; ".join(f"`OMP_NUM_THREADS=1 {c}`" for c in doc["commands"]),
        "",
        f"All on the same {doc['eval']['test_bytes']} test bytes, seed {doc['eval']['seed']}. "
        "The mixture per step is the sampler CE (-log of the mean over the M sweeps) of each "
        "grid point's logits; its first entry is block 0 alone.",
        "",
        "| run | sigma range | sampler | M | sampler CE | from-noise CE | oracle CE | "
        "mixture per step |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for key, run in doc["runs"].items():
        for name, ev in run["evals"].items():
            m, spb, method = name.split("-")
            oracle = "-" if ev["oracle_ce"] is None else f"{ev['oracle_ce']:.3f}"
            mix = ", ".join(f"{v:.3f}" for v in ev["sampler_ce_per_step"])
            rows.append(
                f"| {key} | [{run['sigma'][0]:g}, {run['sigma'][1]:g}] | {method} {spb} | "
                f"{m[1:]} | {ev['sampler_ce']:.3f} | {ev['from_noise_ce']:.3f} | {oracle} | "
                f"{mix} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
