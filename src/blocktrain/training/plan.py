"""What a config costs before anything trains: parameters, optimizer state and weight memory per
worker and for the full model, and the sigma partition (`blocktrain plan`, bench/quality.py)."""

from __future__ import annotations

from typing import Any

import torch

from blocktrain.config import RunConfig
from blocktrain.model import Block, Reference, SigmaSchedule
from blocktrain.training.costs import count_params, worker_memory
from blocktrain.training.optim import ADAMW_BYTES_PER_PARAM


def worker_state_bytes(cfg: RunConfig) -> list[int]:
    """The training memory of each block's worker (`training.costs.worker_memory`'s totals);
    activations not counted."""
    return [memory["total"] for memory in worker_memory(cfg)]


def plan(cfg: RunConfig) -> dict[str, Any]:
    """Parameter and optimizer-state accounting, built on the meta device (no memory)."""
    m = cfg.model
    with torch.device("meta"):
        block = Block(m)  # every block has the same shape
        per_block = count_params(block)
        reference = count_params(Reference(m))
    schedule = SigmaSchedule.from_config(m)
    total = per_block * m.blocks
    return {
        "config": cfg.to_dict(),
        "layers_per_block": m.layers_per_block,
        "sigma_data": m.sigma_data_value,
        "sigma_boundaries": schedule.boundaries(),
        "block_intervals": [list(schedule.interval(b)) for b in range(m.blocks)],
        "block_training_intervals": [list(schedule.training_interval(b)) for b in range(m.blocks)],
        "params_per_block": [per_block] * m.blocks,
        "params_total": total,
        "target_table_values": 256 * m.d_model,
        "optimizer_state_bytes_worker": per_block * ADAMW_BYTES_PER_PARAM,
        "optimizer_state_bytes_full": total * ADAMW_BYTES_PER_PARAM,
        "weight_bytes_fp32_worker": per_block * 4,
        "weight_bytes_fp32_full": total * 4,
        "worker_state_bytes_per_block": worker_state_bytes(cfg),
        "reference_params": reference,
        "reference_optimizer_state_bytes": reference * ADAMW_BYTES_PER_PARAM,
    }
