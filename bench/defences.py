"""The aggregator as it was before the poisoning defences: the "defences none" rows of
bench/adversarial.py (BENCHMARKS.md, Adversaries and faults), and the comparison of
tests/simulate/test_attacks.py. Bench code, not the product's: no command offers these
settings as one switch."""

from __future__ import annotations

import math
from typing import Any

from blocktrain.config import RunConfig
from blocktrain.protocol.core.bounds import largest_block
from blocktrain.training.local import initial_blocks


def loose_delta_norm_bound(cfg: RunConfig, local_steps: int, n_params: int) -> float:
    """The norm bound before the poisoning defences, 4 x lr x H x sqrt(params) (56.25 at the
    tiny preset, 14x the largest honest delta; today's `protocol.core.bounds.delta_norm_bound`
    is 2 x lr x sqrt(H x params), docs/protocol.md, Aggregation)."""
    return 4.0 * cfg.train.lr * local_steps * math.sqrt(n_params)


def undefended(cfg: RunConfig, local_steps: int) -> dict[str, Any]:
    """The aggregator settings before the poisoning defences (the comparison's "defences none"):
    the mean weighted by claimed tokens, no clipping, no effect probe, the loose norm bound, and
    any number of live workers per token (one per token is one of those defences too); nor the
    replay check (identical forged deltas from several tokens are copies), the influence bound
    or drift tracking."""
    n_params = largest_block(initial_blocks(cfg))
    return {
        "rule": "mean",
        "weighting": "reported",
        "clip": 0.0,
        "effect_probe": "off",
        "max_delta_norm": loose_delta_norm_bound(cfg, local_steps, n_params),
        "max_workers_per_token": 1024,
        "replay_rounds": 0,
        "max_influence": 0.0,
        "drift_threshold": 0.0,
    }
