"""The aggregator's effect probe (`protocol.core.effect.EffectProbe`, docs/protocol.md): a block's
own loss (`BlockLoss`, the objective its workers minimise) on a fixed held-out slice, so that
an update can be judged by what it does to the block rather than by its shape or norm.

Deterministic by construction: the same validation windows, and the same sigmas and noise
(drawn once per block from a fixed seed) for every call. The slice starts after the first
`skip_bytes` of the split, so it is disjoint from the evaluation windows (`valid.windows`
from the start) that report the run's CE.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.errors import ProtocolError
from blocktrain.model import BlockStack
from blocktrain.training.loss import BlockLoss
from blocktrain.training.step import stream_seed

Tensors = dict[str, torch.Tensor]

_PROBE_SALT = 7
PROBE_SKIP_BYTES = 16384
"""Where the probe's slice starts in the validation split: the evaluation windows before it
(the live evaluation's, training/live_eval.py) never overlap it."""


class BlockProbe:
    """`loss(block, weights)`: block `block`'s training loss with `weights` on the fixed slice."""

    def __init__(
        self,
        cfg: RunConfig,
        valid: ByteSource,
        *,
        windows: int = 32,
        skip_bytes: int = PROBE_SKIP_BYTES,
    ) -> None:
        t = cfg.model.seq_len
        skip = -(-skip_bytes // t)
        rows = valid.windows(t, (skip + windows) * t)
        self.x = rows[skip:] if len(rows) > skip else rows[-windows:]
        self.cfg = cfg
        # every block, so that under route = features a block reads the committed versions of
        # the blocks before it (`others`)
        self.stack = BlockStack(cfg.model, cfg.seed).eval()
        self.objective = BlockLoss(cfg.model, self.stack.targets, self.stack.upstream)
        self._lock = threading.Lock()  # the aggregator probes from several request threads

    def loss(
        self, block: int, weights: Tensors, others: Mapping[int, Tensors] | None = None
    ) -> float:
        others = others or {}
        reads = range(block) if self.cfg.model.route == "features" else range(0)
        missing = [b for b in reads if b not in others]
        if missing:
            raise ProtocolError(f"block {block}'s probe reads blocks {missing}, not given")
        module = self.stack.block(block)
        with self._lock, torch.no_grad():
            for b in reads:
                self.stack.block(b).load_state_dict({k: v.float() for k, v in others[b].items()})
            module.load_state_dict({k: v.float() for k, v in weights.items()})
            return float(self.objective(module, block, self.x, self.noise(block)).total)

    def noise(self, block: int) -> torch.Generator:
        """The generator of block `block`'s sigmas and noise, fresh and alike at every call (a
        white-box attacker differentiates the probe's loss with it: simulate/attacks)."""
        return torch.Generator().manual_seed(stream_seed(self.cfg.seed, block, 0, _PROBE_SALT))
