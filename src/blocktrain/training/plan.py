"""What a config costs before anything trains: parameters, optimizer state and weight memory per
worker and for the full model, and the sigma partition (`blocktrain plan`, bench/quality.py)."""

from __future__ import annotations

from typing import Any

import torch

from blocktrain.config import RunConfig
from blocktrain.model import Block, Reference, SigmaSchedule
from blocktrain.model.block import MaskedBlock
from blocktrain.model.layers import DualStreamLayer
from blocktrain.training.optim import ADAMW_BYTES_PER_PARAM

TRAINED_BYTES_PER_PARAM = 4 + 4 + ADAMW_BYTES_PER_PARAM  # fp32 weight, gradient, two moments
UPSTREAM_BYTES_PER_PARAM = 2  # a frozen upstream block, held in 16-bit as the wire sends it


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def clean_stream_params(block: Block) -> int:
    """The parameters of a block's clean stream (`Block.clean_stream`): the byte embeddings and
    the layers less their z-stream modulation. What a worker holds of each upstream block under
    `route = features`."""
    modulation = sum(
        _count(layer.modulation)
        for layer in block.layers
        if isinstance(layer, DualStreamLayer) and layer.modulation is not None
    )
    return _count(block.embed) + _count(block.layers) - modulation


def worker_state_bytes(cfg: RunConfig) -> list[int]:
    """The training memory of each block's worker: its block's weights, gradients and AdamW
    moments, plus under `route = features` the clean streams of the blocks before it, frozen
    (activations not counted)."""
    m = cfg.model
    with torch.device("meta"):
        block = MaskedBlock(m, torch.zeros(256, m.d_model)) if m.process == "masked" else Block(m)
        own = _count(block) * TRAINED_BYTES_PER_PARAM
        upstream = clean_stream_params(block) * UPSTREAM_BYTES_PER_PARAM
    if m.route == "state":
        return [own] * m.blocks
    return [own + b * upstream for b in range(m.blocks)]


def plan(cfg: RunConfig) -> dict[str, Any]:
    """Parameter and optimizer-state accounting, built on the meta device (no memory)."""
    m = cfg.model
    with torch.device("meta"):
        # Every block has the same shape; a masked run's blocks add their [MASK] vector.
        block = MaskedBlock(m, torch.zeros(256, m.d_model)) if m.process == "masked" else Block(m)
        per_block = _count(block)
        reference = _count(Reference(m))
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
