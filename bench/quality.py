"""Quality studies of BlockTrain against its end-to-end reference (DESIGN.md 2.8 and 7), each
side by side in one invocation, on the same data and seeds:

  reference  B = 3 against the reference: converged (each until validation CE stops improving)
             and at matched training FLOPs                          -> quality.json
  leakage    sigma in [0.002, 2] against [1, 10]                    -> leakage.json
  depth      1, 2 and 4 layers per block at B = 3                   -> depth.json
  span       K = 1, 4, 16, 64                                       -> span.json
  variants   one design point changed at a time (aux loss, gates, z token, sigma_data,
             overlap) at the fixed budget                           -> variants.json
  memory     peak memory of a one-block worker against the reference, optimizer state against
             `blocktrain plan`                                      -> memory.json

    python bench/quality.py --quick            # the tiny shape, minutes
    python bench/quality.py                    # the small shape: 4 to 5 hours in all, resumable
    python bench/quality.py --report           # its section from the JSON on disk
    python bench/quality.py --studies leakage,depth --quick

Every trained model lives in a run folder under --work (default benchmarks/work/quality[-quick]);
a finished model is not trained again and an interrupted one resumes from its checkpoint, so the
full bench can be stopped and restarted. Test-split figures use M sampler sweeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import load_split
from blocktrain.model import BlockStack, Reference
from blocktrain.presets import preset
from blocktrain.runtime import keep_freed_memory
from blocktrain.training import EvalSettings, Trainer, evaluate_blocktrain, evaluate_reference
from blocktrain.training.plan import plan
from report import (  # bench/report.py
    BENCHMARKS_MD,
    RESEARCH,
    RESULTS,
    ROOT,
    machine,
    train_flops_per_step,
    update_section,
    write_json,
)

# the full mode's section stays in BENCHMARKS.md; quick mode's, superseded by it, is history
SECTION_MD = {"": BENCHMARKS_MD, "-quick": RESEARCH / "quality.md"}
VALID_SWEEPS = 4  # M of the validation CE that early stopping watches: cheap, a looser bound


@dataclass(frozen=True)
class Mode:
    """How much compute each study gets."""

    base: str  # preset the studies start from
    overrides: tuple[str, ...]
    fixed_steps: int  # steps for the fixed-budget studies (leakage, depth, span, matched)
    max_steps: int  # schedule length and cap of the converged runs
    eval_every: int  # validation interval of the converged runs
    patience: int  # evaluations without improvement before a converged run stops
    valid_bytes: int
    test_bytes: int
    sweeps: int  # M for the test-split sampler CE
    memory_overrides: tuple[str, ...]


QUICK = Mode(
    base="tiny",
    overrides=(),
    fixed_steps=200,
    max_steps=1500,
    eval_every=100,
    patience=2,
    valid_bytes=8192,
    test_bytes=16384,
    sweeps=8,
    memory_overrides=("batch_size=2", "precision=fp32"),
)
FULL = Mode(
    base="small",
    overrides=(),
    fixed_steps=300,
    max_steps=1500,
    eval_every=250,
    patience=3,
    valid_bytes=32768,
    test_bytes=32768,
    sweeps=64,  # the sampler CE bound still tightens by 0.015 from M = 16 to 64 (pair_small.json)
    memory_overrides=("batch_size=4", "precision=fp32"),
)


class Bench:
    def __init__(self, mode: Mode, work: Path, data: str | None) -> None:
        self.mode = mode
        self.work = work
        self.train = load_split(data, "train")
        self.valid = load_split(data, "valid")
        self.test = load_split(data, "test")
        self.data = data

    def config(self, *overrides: str) -> RunConfig:
        cfg = apply_overrides(preset(self.mode.base), [*self.mode.overrides, *overrides])
        # the bench evaluates by itself; the trainer only checkpoints
        return apply_overrides(cfg, ["eval_every=0", "log_every=50"])

    # ------------------------------------------------------------------ one model

    def flops_per_step(self, trainer: Trainer) -> int:
        return train_flops_per_step(trainer, self.train)

    def model(self, tag: str, cfg: RunConfig, kind: str, *, converge: bool) -> dict[str, Any]:
        """Train (or resume, or reuse) one model and measure it on the test split."""
        run_dir = self.work / tag
        done = run_dir / "bench_result.json"
        if done.exists():
            return json.loads(done.read_text())
        twin = self.finished_twin(cfg, kind, converge)
        if twin is not None:  # the same model was already trained under another study's name
            print(f"[{tag}] same model as [{twin['tag']}]", flush=True)
            return twin
        progress_file = run_dir / "bench_progress.json"
        if (run_dir / "state.json").exists() and progress_file.exists():
            trainer = Trainer.resume(run_dir, self.train, None)
            progress = json.loads(progress_file.read_text())
        else:
            trainer = Trainer.create(cfg, run_dir, self.train, None, kind=kind, overwrite=True)
            progress = {"curve": [], "best": None, "best_step": 0, "bad": 0}
        flops_step = self.flops_per_step(trainer)
        total = trainer.cfg.train.steps
        interval = self.mode.eval_every if converge else total
        print(f"[{tag}] {kind}, {total} steps max, {flops_step / 1e9:.2f} GFLOP/step", flush=True)
        while trainer.step < total:
            trainer.run(progress=False, until=trainer.step + interval)
            if not converge:
                continue
            val = self.valid_ce(trainer)
            progress["curve"].append(
                {"step": trainer.step, "valid_ce": val, "wall_seconds": trainer.wall_seconds}
            )
            print(f"[{tag}] step {trainer.step}: valid CE {val:.4f}", flush=True)
            if progress["best"] is None or val < progress["best"] - 1e-3:
                progress.update(best=val, best_step=trainer.step, bad=0)
                self.save_best(trainer, run_dir)
            else:
                progress["bad"] += 1
            progress_file.write_text(json.dumps(progress))
            if progress["bad"] >= self.mode.patience:
                break
        steps = trainer.step
        if converge and progress["best"] is not None:
            self.load_best(trainer, run_dir)
            steps = progress["best_step"]
        result = {
            "tag": tag,
            "kind": kind,
            "steps": steps,
            "steps_run": trainer.step,
            "train_flops": flops_step * steps,
            "wall_seconds": trainer.wall_seconds * steps / max(trainer.step, 1),
            "valid_curve": progress["curve"],
            "test": self.test_metrics(trainer),
            "config": trainer.cfg.to_dict(),
            "converge": converge,
        }
        done.write_text(json.dumps(result, indent=2))
        return result

    def finished_twin(self, cfg: RunConfig, kind: str, converge: bool) -> dict[str, Any] | None:
        for path in sorted(self.work.glob("*/bench_result.json")):
            result = json.loads(path.read_text())
            same = (
                result["kind"] == kind
                and result["config"] == cfg.to_dict()
                and result.get("converge", result["tag"].startswith("converged")) == converge
            )
            if same:
                return dict(result)
        return None

    def valid_ce(self, trainer: Trainer) -> float:
        windows = self.valid.windows(trainer.cfg.model.seq_len, self.mode.valid_bytes)
        settings = EvalSettings(sweeps=VALID_SWEEPS, seed=trainer.cfg.seed)
        if trainer.reference is not None:
            return float(evaluate_reference(_eval(trainer.reference), windows, settings)["ce"])
        assert trainer.stack is not None
        return float(evaluate_blocktrain(_eval(trainer.stack), windows, settings)["sampler_ce"])

    def test_metrics(self, trainer: Trainer) -> dict[str, Any]:
        windows = self.test.windows(trainer.cfg.model.seq_len, self.mode.test_bytes)
        settings = EvalSettings(sweeps=self.mode.sweeps, seed=1234)
        if trainer.reference is not None:
            return evaluate_reference(_eval(trainer.reference), windows, settings)
        assert trainer.stack is not None
        return evaluate_blocktrain(_eval(trainer.stack), windows, settings)

    @staticmethod
    def save_best(trainer: Trainer, run_dir: Path) -> None:
        tensors = {
            u.name + k: v.detach().clone()
            for u in trainer.units
            for k, v in u.module.state_dict().items()
        }
        save_file(tensors, str(run_dir / "best.safetensors"))

    @staticmethod
    def load_best(trainer: Trainer, run_dir: Path) -> None:
        tensors = load_file(str(run_dir / "best.safetensors"))
        for u in trainer.units:
            u.module.load_state_dict(
                {k[len(u.name) :]: v for k, v in tensors.items() if k.startswith(u.name)}
            )

    # ------------------------------------------------------------------ studies

    def study_reference(self) -> dict[str, Any]:
        m = self.mode
        base = self.config(f"steps={m.max_steps}")
        bt = self.model("converged-blocktrain", base, "blocktrain", converge=True)
        ref = self.model("converged-reference", base, "reference", converge=True)
        fixed = self.config(f"steps={m.fixed_steps}")
        bt_fixed = self.model("fixed-blocktrain", fixed, "blocktrain", converge=False)
        with tempfile.TemporaryDirectory() as tmp:
            probe = Trainer.create(fixed, Path(tmp) / "probe", self.train, None, kind="reference")
            ref_step_flops = self.flops_per_step(probe)
        # the reference gets the training FLOPs that BlockTrain used for its fixed budget
        matched_steps = max(1, round(bt_fixed["train_flops"] / ref_step_flops))
        ref_matched = self.model(
            "matched-reference", self.config(f"steps={matched_steps}"), "reference", converge=False
        )

        def pair(b: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
            return {
                "blocktrain_sampler_ce": b["test"]["sampler_ce"],
                "blocktrain_from_noise_ce": b["test"]["from_noise_ce"],
                "reference_ce": r["test"]["ce"],
                "gap": b["test"]["sampler_ce"] - r["test"]["ce"],
                "train_flops": {"blocktrain": b["train_flops"], "reference": r["train_flops"]},
                "wall_seconds": {"blocktrain": b["wall_seconds"], "reference": r["wall_seconds"]},
                "steps": {"blocktrain": b["steps"], "reference": r["steps"]},
                "valid_curve": {"blocktrain": b["valid_curve"], "reference": r["valid_curve"]},
                "blocktrain": b["test"],
                "reference": r["test"],
                "config": b["config"],
            }

        return {
            "converged": pair(bt, ref),
            "matched_compute": pair(bt_fixed, ref_matched),
            "sweeps": self.mode.sweeps,
        }

    def fixed(self, tag: str, *overrides: str) -> dict[str, Any]:
        cfg = self.config(f"steps={self.mode.fixed_steps}", *overrides)
        r = self.model(tag, cfg, "blocktrain", converge=False)
        t = r["test"]
        return {
            "oracle_ce": t["oracle_ce"],
            "from_noise_ce": t["from_noise_ce"],
            "sampler_ce": t["sampler_ce"],
            "ce_per_step": t["ce_per_step"],
            "oracle_ce_per_block": t["oracle_ce_per_block"],
            "steps": r["steps"],
            "train_flops": r["train_flops"],
            "wall_seconds": r["wall_seconds"],
            "overrides": list(overrides),
        }

    def study_leakage(self) -> dict[str, Any]:
        return {
            "[0.002, 2]": self.fixed("leak-0.002-2", "sigma_min=0.002", "sigma_max=2"),
            "[1, 10]": self.fixed("leak-1-10", "sigma_min=1", "sigma_max=10"),
        }

    def study_depth(self) -> dict[str, Any]:
        return {
            str(lpb): self.fixed(f"depth-{lpb}", "blocks=3", f"layers={3 * lpb}")
            for lpb in (1, 2, 4)
        }

    def study_span(self) -> dict[str, Any]:
        # T = 128 so that K = 64 still leaves one span of context; same bytes per update
        base = self.config()
        batch = max(1, base.train.batch_size * base.model.seq_len // 128)
        return {
            str(k): self.fixed(f"span-{k}", "seq_len=128", f"batch_size={batch}", f"span={k}")
            for k in (1, 4, 16, 64)
        }

    def study_variants(self) -> dict[str, Any]:
        """One design point changed at a time against the defaults, at the fixed budget: where
        the gap is won or lost (DESIGN.md 2.9's suspects, and the sampler)."""
        out = {
            "defaults": self.fixed("fixed-defaults"),
            "aux_weight=0": self.fixed("var-noaux", "aux_weight=0"),
            "gates_open=false": self.fixed("var-gates-shut", "gates_open=false"),
            "z_prev_byte=false": self.fixed("var-no-prev", "z_prev_byte=false"),
            "sigma_data=0.5": self.fixed("var-sd-0.5", "sigma_data=0.5"),
            "overlap=0": self.fixed("var-overlap-0", "overlap=0"),
        }
        return out

    def study_memory(self) -> dict[str, Any]:
        cfg = apply_overrides(preset("paper"), list(self.mode.memory_overrides))
        planned = plan(cfg)
        out: dict[str, Any] = {
            "preset": "paper",
            "overrides": list(self.mode.memory_overrides),
            "plan": {
                k: planned[k]
                for k in (
                    "params_per_block",
                    "params_total",
                    "optimizer_state_bytes_worker",
                    "optimizer_state_bytes_full",
                    "reference_params",
                    "reference_optimizer_state_bytes",
                )
            },
        }
        for kind in ("block", "reference"):
            cmd = [
                sys.executable,
                str(ROOT / "bench" / "memory_probe.py"),
                "--preset",
                "paper",
                "--kind",
                kind,
                "--set",
                *self.mode.memory_overrides,
            ]
            if self.data:
                cmd += ["--data", self.data]
            print(f"[memory] {kind} ...", flush=True)
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            out[kind] = json.loads(res.stdout.strip().splitlines()[-1])
        out["worker_over_full_optimizer_state"] = (
            out["block"]["optimizer_state_bytes"] / planned["optimizer_state_bytes_full"]
        )
        out["worker_over_reference_peak_rss"] = (
            out["block"]["peak_rss_bytes"] / out["reference"]["peak_rss_bytes"]
        )
        out["optimizer_state_matches_plan"] = (
            out["block"]["optimizer_state_bytes"] == planned["optimizer_state_bytes_worker"]
        )
        return out


def _eval(module: BlockStack | Reference) -> Any:
    return module.eval()


STUDIES = ("reference", "leakage", "depth", "span", "variants", "memory")
JSON_NAME = {"reference": "quality"}  # the other studies write STUDY.json
META = ("command", "mode", "machine")  # what every study's JSON holds beside its results


def json_path(study: str, suffix: str) -> Path:
    return RESULTS / f"{JSON_NAME.get(study, study)}{suffix}.json"


def measured(suffix: str) -> dict[str, Any]:
    """Every study of this mode that has a result on disk, in the usual order."""
    return {
        study: json.loads(json_path(study, suffix).read_text())
        for study in STUDIES
        if json_path(study, suffix).exists()
    }


def tables(results: dict[str, Any]) -> str:
    gib = 1024**3
    commands = sorted({r["command"] for r in results.values()})
    lines = [*(f"Command: `{c}`" for c in commands), ""]
    if "reference" in results:
        q = results["reference"]
        lines += [
            "| comparison | BlockTrain sampler CE | from-noise CE | reference CE | gap | "
            "steps (BT / ref) | train GFLOPs (BT / ref) | wall s (BT / ref) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in ("converged", "matched_compute"):
            r = q[name]
            lines.append(
                f"| {name} | {r['blocktrain_sampler_ce']:.4f} | {r['blocktrain_from_noise_ce']:.4f}"
                f" | {r['reference_ce']:.4f} | {r['gap']:+.4f} | {r['steps']['blocktrain']} / "
                f"{r['steps']['reference']} | {r['train_flops']['blocktrain'] / 1e9:,.0f} / "
                f"{r['train_flops']['reference'] / 1e9:,.0f} | "
                f"{r['wall_seconds']['blocktrain']:.0f} / {r['wall_seconds']['reference']:.0f} |"
            )
        lines += [
            "",
            f"Sampler CE over M = {q['sweeps']} sweeps; all CE in nats/byte on the test split.",
            "",
        ]
        bt = q["converged"]["blocktrain"]
        if "sampler_ce_per_step" in bt:  # results older than these diagnostics lack them
            by_m = {**bt["sampler_ce_by_sweeps"], str(q["sweeps"]): bt["sampler_ce"]}
            lines += [
                "Converged BlockTrain's sampler CE by the number of sweeps M: "
                + ", ".join(f"M = {m}: {ce:.4f}" for m, ce in by_m.items())
                + "; the mixture after each block: "
                + " / ".join(f"{ce:.4f}" for ce in bt["sampler_ce_per_step"])
                + ".",
                "",
            ]
        curves = q["converged"].get("valid_curve", {})
        if any(curves.values()):
            lines += [
                "Validation CE of the converged runs (BlockTrain: sampler CE, "
                f"M = {VALID_SWEEPS}), by step:",
                "",
            ]
            for kind, curve in curves.items():
                points = ", ".join(f"{p['step']}: {p['valid_ce']:.4f}" for p in curve)
                lines.append(f"- {kind}: {points}")
            lines.append("")
    for study, label in (
        ("leakage", "sigma range"),
        ("depth", "layers per block"),
        ("span", "span K"),
        ("variants", "one change from the defaults"),
    ):
        if study not in results:
            continue
        lines += [
            f"| {label} | oracle CE | from-noise CE | sampler CE | CE per step |",
            "|---|---:|---:|---:|---|",
        ]
        for key, r in results[study].items():
            if key in META:
                continue
            lines.append(
                f"| {key} | {r['oracle_ce']:.4f} | {r['from_noise_ce']:.4f} | "
                f"{r['sampler_ce']:.4f} | "
                f"{', '.join(f'{v:.3f}' for v in r['ce_per_step'])} |"
            )
        lines.append("")
    if "memory" in results:
        m = results["memory"]
        lines += [
            "| process (paper shape, " + ", ".join(m["overrides"]) + ") | parameters | "
            "AdamW state GiB | peak RSS GiB |",
            "|---|---:|---:|---:|",
        ]
        for kind in ("block", "reference"):
            r = m[kind]
            lines.append(
                f"| {kind} | {r['params']:,} | {r['optimizer_state_bytes'] / gib:.3f} | "
                f"{r['peak_rss_bytes'] / gib:.3f} |"
            )
        lines += [
            "",
            f"Full model AdamW state (plan): "
            f"{m['plan']['optimizer_state_bytes_full'] / gib:.3f} GiB; the worker holds "
            f"{m['worker_over_full_optimizer_state']:.3f} of it (1/B = "
            f"{1 / len(m['plan']['params_per_block']):.3f}); measured state equals the "
            f"plan: {m['optimizer_state_matches_plan']}. Worker peak RSS / reference "
            f"peak RSS: {m['worker_over_reference_peak_rss']:.2f}.",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the tiny shape, minutes")
    p.add_argument("--studies", default=",".join(STUDIES))
    p.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    p.add_argument("--work", type=Path, default=None, help="run folders (resumable)")
    p.add_argument(
        "--report", action="store_true", help="only rewrite its section from the JSON on disk"
    )
    args = p.parse_args()
    suffix = "-quick" if args.quick else ""
    if args.report:
        update_section(f"quality{suffix}", tables(measured(suffix)), SECTION_MD[suffix])
        return
    keep_freed_memory()
    mode = QUICK if args.quick else FULL
    work = args.work or ROOT / "benchmarks" / "work" / f"quality{suffix}"
    bench = Bench(mode, work, args.data)
    started = time.time()
    command = ("python bench/quality.py " + " ".join(sys.argv[1:])).strip()
    for study in args.studies.split(","):
        if study not in STUDIES:
            p.error(f"unknown study {study!r}; choose from {', '.join(STUDIES)}")
    for study in args.studies.split(","):
        result = getattr(bench, f"study_{study}")()
        # written as each study ends, so an interrupted bench keeps what it measured
        write_json(
            json_path(study, suffix).name,
            {"command": command, "mode": dataclasses.asdict(mode), "machine": machine(), **result},
        )
        update_section(f"quality{suffix}", tables(measured(suffix)), SECTION_MD[suffix])
    print(f"done in {(time.time() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
