"""A research probe for "Do blocks compose?": which noise interval should read the deepest
features?

Under `route = features` the clean-stream chain runs in block order (block b reads blocks
0..b-1) and block 0 owns the highest noise interval, so the block that reads the deepest
features denoises the lowest noise, where the state z already pins the byte down; the sampler's
CE per step (compose.json) shows the last block of three adding almost nothing. The clean
stream depends on the context only, so nothing forces that pairing: this probe trains the same
stack with the intervals in reverse (block 0, the shallowest, owns the lowest noise; the deepest
block the highest, and the sweep visits it first), by patching `SigmaSchedule` in this process,
and scores both on the same test bytes with the same in-process evaluation.

Bench-only on purpose: a reversed sweep would need the hosts' features before the sweep reaches
them (one-sweep serving passes them forward), so it becomes a product setting only if it wins.

    python bench/compose_order.py --preset tiny --seeds 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from blocktrain.data import load_split, resolve_data_path
from blocktrain.model import BlockStack
from blocktrain.model.sigma import SigmaSchedule
from blocktrain.training import EvalSettings, Trainer, evaluate_blocktrain, load_model
from compose import DEFAULT_SWEEPS, WORK, Row
from report import machine, update_section, write_json

RESULT = "compose_order.json"


@contextlib.contextmanager
def reversed_intervals() -> Iterator[None]:
    """Block b owns the interval block B-1-b owns normally; the grid visits blocks B-1..0."""
    interval, grid = SigmaSchedule.interval, SigmaSchedule.sampler_grid

    def flipped_interval(self: SigmaSchedule, block: int) -> tuple[float, float]:
        return interval(self, self.blocks - 1 - block)

    def flipped_grid(self: SigmaSchedule, steps_per_block: int) -> list[tuple[int, float]]:
        return [(self.blocks - 1 - b, s) for b, s in grid(self, steps_per_block)]

    SigmaSchedule.interval = flipped_interval  # type: ignore[method-assign]
    SigmaSchedule.sampler_grid = flipped_grid  # type: ignore[method-assign]
    try:
        yield
    finally:
        SigmaSchedule.interval = interval  # type: ignore[method-assign]
        SigmaSchedule.sampler_grid = grid  # type: ignore[method-assign]


def score(run: Path, test: torch.Tensor, sweeps: int) -> dict[str, Any]:
    _, stack = load_model(run)
    assert isinstance(stack, BlockStack)
    ev = evaluate_blocktrain(stack, test, EvalSettings(sweeps=sweeps, seed=0))
    return {k: ev[k] for k in ("sampler_ce", "from_noise_ce", "sampler_ce_per_step")}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0])
    p.add_argument("--bytes", type=int, default=32768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = resolve_data_path(args.data)
    sweeps = DEFAULT_SWEEPS[args.preset]
    lpb = {"tiny": 1, "small": 2}[args.preset]
    row = Row(args.preset, "blocktrain", args.blocks, lpb, "features", args.steps)
    seq_len = row.config(0, args.threads).model.seq_len
    test = load_split(data, "test").windows(seq_len, args.bytes)
    out = []
    for seed in args.seeds:
        cfg = row.config(seed, args.threads)
        forward = WORK / f"{row.key}-seed{seed}"  # compose.py's run of the same row
        if not (forward / "state.json").exists():
            sys.exit(f"compose_order: train {forward} first (python bench/compose.py ...)")
        flipped = WORK / f"{row.key}-reversed-seed{seed}"
        with reversed_intervals():
            state = flipped / "state.json"
            if not state.exists() or json.loads(state.read_text())["step"] < args.steps:
                print(f"training {flipped} (intervals reversed)", file=sys.stderr, flush=True)
                train = load_split(data, "train")
                Trainer.create(cfg, flipped, train, None, overwrite=True).run(progress=False)
            reverse = score(flipped, test, sweeps)
        out.append(
            {
                "seed": seed,
                "forward": score(forward, test, sweeps),
                "reversed": reverse,
            }
        )
        print(json.dumps(out[-1]), flush=True)
    result = {
        "command": " ".join(["python bench/compose_order.py", *sys.argv[1:]]),
        "row": row.key,
        "sweeps": sweeps,
        "test_bytes": args.bytes,
        "machine": machine(),
        "seeds": out,
    }
    write_json(RESULT, result)
    lines = [
        f"`{result['command']}` (JSON `benchmarks/results/{RESULT}`): {row.blocks} blocks of "
        f"{lpb} layer(s), `route = features`, {args.steps} steps, the sampler CE (M = {sweeps}) "
        f"on {args.bytes:,} test bytes, both orders scored in one process.",
        "",
        "| seed | order | sampler CE | CE after each block, in sweep order |",
        "|---|---|---:|---|",
    ]
    for r in out:
        for order in ("forward", "reversed"):
            ev = r[order]
            steps = ", ".join(f"{v:.3f}" for v in ev["sampler_ce_per_step"])
            lines.append(f"| {r['seed']} | {order} | {ev['sampler_ce']:.3f} | {steps} |")
    update_section("compose-order", "\n".join(lines))


if __name__ == "__main__":
    main()
