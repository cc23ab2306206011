"""Settings derived from the run: the bounds on what an honest update can be (its delta's L2
norm, the tokens it claims) from the run config, the local steps H and the largest block's size
(`largest_block`), and the aggregator settings that take them (`derived_settings`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from blocktrain.config import RunConfig
from blocktrain.protocol.core.settings import AggregatorSettings

TIGHT_SLACK = 2.0
"""Measured (docs/protocol.md, Aggregation): honest deltas at the tiny preset reach at most
0.89 x lr x sqrt(H x params) (3.96 of 4.45, right after warmup), so 2 leaves 2.2x room."""


def delta_norm_bound(
    cfg: RunConfig, local_steps: int, n_params: int, slack: float = TIGHT_SLACK
) -> float:
    """A bound on the L2 norm of an honest worker's delta: slack x lr x sqrt(H x n_params).
    AdamW moves each coordinate by about lr per step, and over H steps those moves add up like
    a random walk (their signs decorrelate), not in a line; `slack` covers what honest workers
    were measured to send, and the first steps of a run, whose moves do line up (H x lr at
    most, within the slack for H <= 4)."""
    return slack * cfg.train.lr * math.sqrt(local_steps * n_params)


def token_bound(cfg: RunConfig, local_steps: int, slack: float = 2.0) -> int:
    """The most target bytes an honest update can claim: H batches of B x T, with slack."""
    return int(slack * local_steps * cfg.train.batch_size * cfg.model.seq_len)


def largest_block(blocks: dict[int, dict[str, torch.Tensor]]) -> int:
    """The parameter count of the largest block."""
    return max(sum(t.numel() for t in w.values()) for w in blocks.values())


def derived_settings(
    cfg: RunConfig, overrides: dict[str, Any], block_params: int
) -> AggregatorSettings:
    """Aggregator settings for a run of `cfg` whose largest block has `block_params`
    parameters: the defaults, then `overrides`, with the delta norm and token bounds derived
    from the run unless they are overridden."""
    base = AggregatorSettings().replace(
        **{k: v for k, v in overrides.items() if k not in ("max_delta_norm", "max_tokens")}
    )
    return base.replace(
        max_delta_norm=overrides.get(
            "max_delta_norm", delta_norm_bound(cfg, base.local_steps, block_params)
        ),
        max_tokens=overrides.get("max_tokens", token_bound(cfg, base.local_steps)),
    )
