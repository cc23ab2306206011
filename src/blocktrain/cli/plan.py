"""`blocktrain plan`: the resolved config and what it costs, without training anything."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from blocktrain.cli.common import Formatter, add_config_args, print_json, resolve_config
from blocktrain.config import RunConfig
from blocktrain.model import Block, Reference, SigmaSchedule

ADAMW_BYTES_PER_PARAM = 8  # two fp32 moments per parameter

EXAMPLES = """examples:
  blocktrain plan --preset paper --json
  blocktrain plan --preset small --set layers=12 blocks=4
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show a config's shape, parameters and memory",
                       description=__doc__, epilog=EXAMPLES, formatter_class=Formatter)
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def plan(cfg: RunConfig) -> dict[str, Any]:
    """Parameter and optimizer-state accounting, built on the meta device (no memory)."""
    m = cfg.model
    with torch.device("meta"):
        per_block = _count(Block(m))  # every block has the same shape
        reference = _count(Reference(m))
    schedule = SigmaSchedule.from_config(m)
    total = per_block * m.blocks
    return {
        "config": cfg.to_dict(),
        "layers_per_block": m.layers_per_block,
        "sigma_data": m.sigma_data_value,
        "sigma_boundaries": schedule.boundaries(),
        "block_intervals": [list(schedule.interval(b)) for b in range(m.blocks)],
        "block_training_intervals": [list(schedule.training_interval(b))
                                     for b in range(m.blocks)],
        "params_per_block": [per_block] * m.blocks,
        "params_total": total,
        "target_table_values": 256 * m.d_model,
        "optimizer_state_bytes_worker": per_block * ADAMW_BYTES_PER_PARAM,
        "optimizer_state_bytes_full": total * ADAMW_BYTES_PER_PARAM,
        "weight_bytes_fp32_worker": per_block * 4,
        "weight_bytes_fp32_full": total * 4,
        "reference_params": reference,
        "reference_optimizer_state_bytes": reference * ADAMW_BYTES_PER_PARAM,
    }


def run(args: argparse.Namespace) -> int:
    result = plan(resolve_config(args))
    if args.json:
        print_json(result)
        return 0
    m = result["config"]["model"]
    gib = 1024**3
    print(f"preset {result['config']['preset']}: {m['blocks']} blocks x "
          f"{result['layers_per_block']} layers, d = {m['d_model']}, T = {m['seq_len']}, "
          f"K = {m['span']}")
    print(f"  sigma boundaries  {', '.join(f'{s:.4f}' for s in result['sigma_boundaries'])}")
    print(f"  params per block  {result['params_per_block'][0]:,}")
    print(f"  params total      {result['params_total']:,}  "
          f"(reference {result['reference_params']:,})")
    print(f"  AdamW state       worker {result['optimizer_state_bytes_worker'] / gib:.4f} GiB, "
          f"full model {result['optimizer_state_bytes_full'] / gib:.4f} GiB")
    return 0
