"""Shared by the bench scripts: where results go, and the tables in BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from blocktrain.data import ByteSource
from blocktrain.training import Trainer
from blocktrain.training.flops import count_flops

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def update_section(name: str, markdown: str) -> None:
    """Replace the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in BENCHMARKS.md
    (appending the section if it is not there yet)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else (text.rstrip() + "\n\n" + block + "\n")
    )
    BENCHMARKS_MD.write_text(text)


def train_flops_per_step(trainer: Trainer, source: ByteSource) -> int:
    """Training FLOPs of one step of `trainer`, counted as the code runs (3 x forward)."""
    cfg = trainer.cfg
    x = source.sample(cfg.train.batch_size, cfg.model.seq_len, torch.Generator().manual_seed(0))
    x = x.to(trainer.device)
    total = 0
    for unit in trainer.units:

        def forward(unit: Any = unit) -> None:
            with torch.no_grad(), trainer._autocast():
                if trainer.stack is not None:
                    gen = torch.Generator(trainer.device).manual_seed(0)
                    trainer.loss(unit.module, unit.index, x, gen)
                else:
                    unit.module(x)

        total += 3 * count_flops(forward).total
    return total
