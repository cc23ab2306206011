"""`blocktrain eval`: quality of a trained run on held-out text, in nats per byte."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blocktrain.cli.common import Formatter, add_data_arg, print_json
from blocktrain.data import load_split
from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.model import BlockStack, Reference
from blocktrain.training import EvalSettings, evaluate_blocktrain, evaluate_reference, load_model

EXAMPLES = """examples:
  blocktrain eval runs/tiny                          # validation split, 16 sweeps
  blocktrain eval runs/tiny --split test --json      # JSON: sampler_ce, from_noise_ce, ...
  blocktrain eval runs/tiny --against runs/ref       # the reference on the same bytes
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a run on held-out text",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by train")
    add_data_arg(p)
    p.add_argument("--split", default="valid", choices=("valid", "test"))
    p.add_argument("--bytes", type=int, default=32768, help="held-out bytes to evaluate")
    p.add_argument("--sweeps", type=int, default=16, help="M, sampler sweeps from pure noise")
    p.add_argument("--steps-per-block", type=int, default=1, help="sampler points per block")
    p.add_argument(
        "--sampler",
        default="euler",
        choices=("euler", "ancestral"),
        help="Euler steps, or re-noising from a sampled byte at every step",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the noise")
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward pass")
    p.add_argument(
        "--against",
        metavar="REF_RUN_DIR",
        help="also evaluate this reference run on the same bytes",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in ("bytes", "sweeps", "steps_per_block", "batch_size"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    info, model = load_model(Path(args.run_dir))
    ref = None
    if args.against:
        ref_info, ref = load_model(Path(args.against))
        if ref_info.kind != "reference":
            raise CheckpointError(f"--against {args.against} is not a reference run")
        if ref_info.config.model.seq_len != info.config.model.seq_len:
            raise CheckpointError("--against: the two runs use different seq_len")
    source = load_split(args.data, args.split)
    windows = source.windows(info.config.model.seq_len, args.bytes)
    settings = EvalSettings(
        sweeps=args.sweeps,
        steps_per_block=args.steps_per_block,
        seed=args.seed,
        batch_size=args.batch_size,
        sampler=args.sampler,
    )
    result: dict[str, Any] = {"run_dir": str(args.run_dir), "kind": info.kind, "split": args.split}
    if isinstance(model, Reference):
        result.update(evaluate_reference(model, windows, settings))
    else:
        assert isinstance(model, BlockStack)
        if not model.has_all_blocks():
            raise CheckpointError(
                f"{args.run_dir} holds only block(s) {model.block_ids} of {info.config.model.blocks};"
                " evaluation needs the assembled model"
            )
        result.update(evaluate_blocktrain(model, windows, settings))
    if ref is not None:
        assert isinstance(ref, Reference)
        result["reference"] = evaluate_reference(ref, windows, settings)
    if args.json:
        print_json(result)
    else:
        _print_table(result)
    return 0


def _print_table(r: dict[str, Any]) -> None:
    print(f"{r['run_dir']} ({r['kind']}) on {r['split']}, {r['bytes']} bytes")
    if r["kind"] == "reference":
        print(
            f"  CE            {r['ce']:.4f} nats/byte  ({r['bits_per_byte']:.4f} bits/byte, "
            f"perplexity {r['perplexity']:.3f})"
        )
    else:
        print(
            f"  sampler CE    {r['sampler_ce']:.4f} nats/byte  ({r['bits_per_byte']:.4f} "
            f"bits/byte, perplexity {r['perplexity']:.3f}; M = {r['sweeps']} sweeps)"
        )
        print(f"  from-noise CE {r['from_noise_ce']:.4f}  (one sweep)")
        print(f"  CE per step   {', '.join(f'{v:.3f}' for v in r['ce_per_step'])}")
        print(
            f"  oracle CE     {r['oracle_ce']:.4f}  (per block "
            f"{', '.join(f'{v:.3f}' for v in r['oracle_ce_per_block'])})"
        )
    if "reference" in r:
        print(f"  reference CE  {r['reference']['ce']:.4f}  (same bytes)")
