"""The aggregator's effect probe (`protocol.effect.EffectProbe`, docs/protocol.md): a block's
own loss (`BlockLoss`, the objective its workers minimise) on a fixed held-out slice, so that
an update can be judged by what it does to the block rather than by its shape or norm.

Deterministic by construction: the same validation windows, and the same sigmas and noise
(drawn once per block from a fixed seed) for every call. The slice starts after the first
`skip_bytes` of the split, so it is disjoint from the evaluation windows (`valid.windows`
from the start) that report the run's CE.
"""

from __future__ import annotations

import threading

import torch

from blocktrain.config import RunConfig, require_state_route
from blocktrain.data import ByteSource
from blocktrain.model import init_block, target_table
from blocktrain.training.loss import BlockLoss
from blocktrain.training.step import stream_seed

Tensors = dict[str, torch.Tensor]

_PROBE_SALT = 7


class BlockProbe:
    """`loss(block, weights)`: block `block`'s training loss with `weights` on the fixed slice."""

    def __init__(
        self,
        cfg: RunConfig,
        valid: ByteSource,
        *,
        windows: int = 32,
        skip_bytes: int = 16384,
    ) -> None:
        require_state_route(cfg.model, "the aggregator's effect probe")
        t = cfg.model.seq_len
        skip = -(-skip_bytes // t)
        rows = valid.windows(t, (skip + windows) * t)
        self.x = rows[skip:] if len(rows) > skip else rows[-windows:]
        self.cfg = cfg
        self.objective = BlockLoss(cfg.model, target_table(cfg.seed, cfg.model.d_model))
        self.modules = {
            b: init_block(cfg.model, cfg.seed, b).eval() for b in range(cfg.model.blocks)
        }
        self._lock = threading.Lock()  # the aggregator probes from several request threads

    def loss(self, block: int, weights: Tensors) -> float:
        module = self.modules[block]
        with self._lock, torch.no_grad():
            module.load_state_dict({k: v.float() for k, v in weights.items()})
            gen = torch.Generator().manual_seed(stream_seed(self.cfg.seed, block, 0, _PROBE_SALT))
            return float(self.objective(module, block, self.x, gen).total)
