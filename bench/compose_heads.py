"""A research probe for "Do blocks compose?": how good is each block's next-byte head?

Every block's clean stream carries a next-byte head, trained by the auxiliary term of its local
loss (docs/model.md). Under `route = features` the clean streams chain, so the last block's head
is a greedy block-wise autoregressive model of the stack's depth (decoupled greedy learning),
trained by nothing but the blocks' own losses: the issue's control. Scored on the true context
(no sampler, no noise), it says what the chain of features holds, beside what the sampler makes
of it (compose.json's sampler CE, the same test bytes).

Reads the trained runs of bench/compose.py and bench/compose_order.py (benchmarks/work/compose/)
and scores each on the same 32,768 test bytes; trains nothing.

    python bench/compose_heads.py --preset tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from blocktrain.data import load_split, resolve_data_path
from blocktrain.model import BlockStack
from blocktrain.training import load_model
from blocktrain.training.evaluate import head_nll
from compose import RESULT as COMPOSE_RESULT
from compose import WORK, Row
from report import ROOT, machine, update_section, write_json

RESULT = "compose_heads.json"


def heads(run: Path, test: torch.Tensor, batch: int = 16) -> list[float]:
    """Each block's head CE (nats/byte) on bytes 1..T-1 of the test windows."""
    _, stack = load_model(run)
    assert isinstance(stack, BlockStack)
    nll = [0.0] * stack.cfg.blocks
    for start in range(0, test.shape[0], batch):
        x = test[start : start + batch]
        for b in range(stack.cfg.blocks):
            nll[b] += head_nll(stack, b, x)
    scored = test.shape[0] * (test.shape[1] - 1)
    return [v / scored for v in nll]


def sampler_ce(run: Path) -> float | None:
    """The run's sampler CE as compose.json (or compose_order.json, for a reversed run)
    recorded it, if any."""
    results = ROOT / "benchmarks" / "results"
    compose = results / COMPOSE_RESULT
    if compose.exists():
        for row in json.loads(compose.read_text())["rows"]:
            fields = {k: row[k] for k in (f.name for f in dataclasses.fields(Row))}
            for seed, by_seed in row["by_seed"].items():
                if f"{Row(**fields).key}-seed{seed}" == run.name:
                    return float(by_seed["test_ce"])
    order = results / "compose_order.json"
    if order.exists():
        doc = json.loads(order.read_text())
        for entry in doc["seeds"]:
            if run.name == f"{doc['row']}-reversed-seed{entry['seed']}":
                return float(entry["reversed"]["sampler_ce"])
    return None


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    p.add_argument("--bytes", type=int, default=32768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = resolve_data_path(args.data)
    rows: list[dict[str, Any]] = []
    tests: dict[int, torch.Tensor] = {}
    for run in sorted(WORK.glob(f"{args.preset}-blocktrain-*")):
        if not (run / "model.safetensors").exists():
            continue
        seq_len = json.loads((run / "config.json").read_text())["model"]["seq_len"]
        if seq_len not in tests:
            tests[seq_len] = load_split(data, "test").windows(seq_len, args.bytes)
        print(f"scoring {run.name}", file=sys.stderr, flush=True)
        cfg = json.loads((run / "config.json").read_text())["model"]
        per_block = heads(run, tests[seq_len])
        rows.append(
            {
                "run": run.name,
                "preset": args.preset,
                "blocks": cfg["blocks"],
                "layers_per_block": cfg["layers"] // cfg["blocks"],
                "route": cfg["route"],
                "reversed": "reversed" in run.name,
                "head_ce_per_block": per_block,
                "sampler_ce": sampler_ce(run),
            }
        )
    old = ROOT / "benchmarks" / "results" / RESULT
    kept = (
        [r for r in json.loads(old.read_text())["rows"] if r["preset"] != args.preset]
        if old.exists()
        else []
    )
    doc = {"machine": machine(), "bytes": args.bytes, "rows": kept + rows}
    write_json(RESULT, doc)
    update_section("compose-heads", table(doc))


def table(doc: dict[str, Any]) -> str:
    lines = [
        "`python bench/compose_heads.py --preset tiny` (and `--preset small`; JSON "
        f"`benchmarks/results/{RESULT}`): every run of bench/compose.py and compose_order.py "
        f"scored again on the same {doc['bytes']:,} test bytes, by each block's clean-stream "
        "next-byte head on the true context (no sampler), beside the run's sampler CE.",
        "",
        "| run | blocks x layers | route | head CE after each block | last head | sampler CE |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in sorted(doc["rows"], key=lambda r: (r["preset"], r["route"], r["blocks"], r["run"])):
        heads_text = ", ".join(f"{v:.3f}" for v in r["head_ce_per_block"])
        sampler = "" if r["sampler_ce"] is None else f"{r['sampler_ce']:.3f}"
        route = r["route"] + (", reversed" if r["reversed"] else "")
        lines.append(
            f"| {r['run']} | {r['blocks']} x {r['layers_per_block']} | {route} | {heads_text} "
            f"| {r['head_ce_per_block'][-1]:.3f} | {sampler} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
