"""Small helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from blocktrain.config import PRESETS, RunConfig, apply_overrides, preset


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="named configuration to start from (default: tiny)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        nargs="+",
        default=[],
        action="extend",
        help="override a config field, e.g. --set d_model=256 lr=1e-3",
    )


def resolve_config(args: argparse.Namespace) -> RunConfig:
    cfg = apply_overrides(preset(args.preset), list(args.overrides))
    if getattr(args, "seed", None) is not None:
        cfg = apply_overrides(cfg, [f"seed={args.seed}"])
    if getattr(args, "steps", None) is not None:
        cfg = apply_overrides(cfg, [f"steps={args.steps}"])
    return cfg


def resolve_rounds_config(args: argparse.Namespace, local_steps: int) -> RunConfig:
    """The config of a run of `args.rounds` rounds of H local steps: unless --set gives
    `steps`, the learning-rate schedule spans the run (round r runs steps r*H .. r*H + H - 1)."""
    cfg = resolve_config(args)
    if not any(
        item.split("=", 1)[0].strip() in ("steps", "train.steps") for item in args.overrides
    ):
        cfg = apply_overrides(cfg, [f"steps={args.rounds * local_steps}"])
    return cfg


def add_data_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        metavar="PATH",
        help="a WikiText raw folder, a text file or a folder of text files "
        "(default: $BLOCKTRAIN_DATA)",
    )


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the examples' line breaks and show defaults."""
