"""Peak memory of one process that trains either one BlockTrain block (what a worker holds) or
the end-to-end reference, for a few steps. Run by bench/quality.py in a fresh process per
measurement, so that each peak is its own:

    python bench/memory_probe.py --preset paper --set batch_size=2 precision=fp32 --kind block
    python bench/memory_probe.py --preset paper --set batch_size=2 precision=fp32 --kind reference

Prints one JSON object: peak resident memory (ru_maxrss), the resident memory before the model
was built, the parameters held and the AdamW state actually allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.presets import preset
from blocktrain.runtime import keep_freed_memory
from blocktrain.training import Trainer


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="paper")
    p.add_argument("--set", dest="overrides", nargs="+", default=[])
    p.add_argument("--kind", choices=("block", "reference"), required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--data", default=None)
    args = p.parse_args()
    keep_freed_memory()
    cfg = apply_overrides(
        preset(args.preset), [*args.overrides, f"steps={args.steps}", "device=cpu"]
    )
    train = load_split(args.data, "train")
    torch.set_grad_enabled(True)
    before = rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer.create(
            cfg,
            Path(tmp) / "run",
            train,
            None,
            kind="reference" if args.kind == "reference" else "blocktrain",
            blocks=None if args.kind == "reference" else [0],
        )
        for _ in range(args.steps):
            trainer.train_step()
            trainer.step += 1
        unit = trainer.units[0]
        params = sum(p.numel() for p in unit.module.parameters())
        opt_bytes = sum(
            t.numel() * t.element_size()
            for state in unit.optimizer.state.values()
            for k, t in state.items()
            if k in ("exp_avg", "exp_avg_sq")
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "kind": args.kind,
                "peak_rss_bytes": peak,
                "rss_before_model_bytes": before,
                "params": params,
                "optimizer_state_bytes": opt_bytes,
                "batch_size": cfg.train.batch_size,
                "seq_len": cfg.model.seq_len,
            }
        )
    )


if __name__ == "__main__":
    main()
