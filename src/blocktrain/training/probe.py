"""The aggregator's effect probe (docs/protocol.md, "Effect probe"): a block's own loss on a
held-out slice, window by window, so that an update is judged by what it does to the block rather
than by its shape or norm.

Deterministic for a given (block, draw). Without a secret every draw is the public slice, which
anyone can rebuild from the public config and data; with one, each draw picks its windows and
noise from the secret, so a worker cannot tune an update to the slice it will be judged on. The
public slice starts after `skip_bytes`, disjoint from the evaluation windows; a secret pool's
windows lie at secret places after it, so fitting the public slice (or an article's next
windows) fits none of them."""

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
# where the probe's slice starts in the validation split: the evaluation windows before it
# (the live evaluation's, training/live_eval.py) never overlap it
PROBE_SKIP_BYTES = 16384
POOL = 8  # a secret probe's pool, in slices: 8 x 32 windows of T bytes
# a secret pool's windows lie at secret places in this much of the split after the public
# slice (all of it when shorter): not next to the public slice, whose text an attacker can fit
SPREAD_BYTES = 4 << 20


class BlockProbe:
    """`window_losses(block, weights)`: block `block`'s training loss with `weights` on each
    window of the slice."""

    def __init__(
        self,
        cfg: RunConfig,
        valid: ByteSource,
        *,
        windows: int = 32,
        skip_bytes: int = PROBE_SKIP_BYTES,
        secret: int | None = None,
    ) -> None:
        t = cfg.model.seq_len
        skip = -(-skip_bytes // t)
        public_bytes = (skip + windows) * t
        # one read: the public slice, and with a secret the stretch its pool is drawn from
        rows = valid.windows(t, public_bytes if secret is None else max(SPREAD_BYTES, public_bytes))
        self.x = rows[skip : skip + windows] if len(rows) > skip else rows[-windows:]
        """The public slice: every draw's when there is no secret."""
        self.pool = self.x
        if secret is not None:
            rest = rows[skip + windows :]
            if len(rest) >= windows:  # else a split too short for more: the public slice
                pick = torch.randperm(len(rest), generator=torch.Generator().manual_seed(secret))
                self.pool = rest[pick[: POOL * windows]]
        self.secret = secret
        self.cfg = cfg
        # every block, so that under route = features a block reads the committed versions of
        # the blocks before it (`others`)
        self.stack = BlockStack(cfg.model, cfg.seed).eval()
        self.objective = BlockLoss(cfg.model, self.stack.targets, self.stack.upstream)
        self._lock = threading.Lock()  # the aggregator probes from several request threads

    def loss(
        self, block: int, weights: Tensors, others: Mapping[int, Tensors] | None = None
    ) -> float:
        return float(self.window_losses(block, weights, others).mean())

    def window_losses(
        self,
        block: int,
        weights: Tensors,
        others: Mapping[int, Tensors] | None = None,
        draw: int = 0,
    ) -> torch.Tensor:
        """The loss of each window of draw `draw`'s slice, (windows,): a paired test compares
        two weights window by window, on the same bytes, sigmas and noise."""
        with self._lock, torch.no_grad():
            return self._rows(block, weights, others, draw).detach()

    def gradient(
        self,
        block: int,
        weights: Tensors,
        others: Mapping[int, Tensors] | None = None,
        draw: int = 0,
    ) -> Tensors:
        """The gradient of the mean of `window_losses(block, weights, others, draw)` with
        respect to the block's weights (one backward pass; the gain test's, once per version)."""
        module = self.stack.block(block)
        with self._lock, torch.enable_grad():
            rows = self._rows(block, weights, others, draw)
            params = dict(module.named_parameters())
            grads = torch.autograd.grad(rows.mean(), list(params.values()), allow_unused=True)
        got = {name: g for name, g in zip(params, grads, strict=True) if g is not None}
        return {
            k: got[k].detach() if k in got else torch.zeros_like(w.float())
            for k, w in weights.items()
        }

    def _rows(
        self, block: int, weights: Tensors, others: Mapping[int, Tensors] | None, draw: int
    ) -> torch.Tensor:
        """Each window's loss with `weights` loaded (under the lock, in the caller's grad mode)."""
        others = others or {}
        x, seed = self._slice(block, draw)
        reads = range(block) if self.cfg.model.reads_upstream else range(0)
        missing = [b for b in reads if b not in others]
        if missing:
            raise ProtocolError(f"block {block}'s probe reads blocks {missing}, not given")
        module = self.stack.block(block)
        with torch.no_grad():
            for b in reads:
                self.stack.block(b).load_state_dict({k: v.float() for k, v in others[b].items()})
            module.load_state_dict({k: v.float() for k, v in weights.items()})
        gen = torch.Generator().manual_seed(seed)
        parts = self.objective(module, block, x, gen)
        assert parts.rows is not None  # BlockLoss always gives them
        return parts.rows()

    def _slice(self, block: int, draw: int) -> tuple[torch.Tensor, int]:
        """The windows and the noise seed of (block, draw)."""
        if self.secret is None:
            return self.x, self._public_seed(block)
        seed = stream_seed(self.secret, block, draw, _PROBE_SALT)
        pick = torch.randperm(len(self.pool), generator=torch.Generator().manual_seed(seed))
        return self.pool[pick[: len(self.x)]], seed

    def noise(self, block: int) -> torch.Generator:
        """The generator of block `block`'s sigmas and noise on the public slice (`x`), fresh
        and alike at every call: a white-box attacker, who knows no secret, differentiates
        the public probe's loss with it (simulate/attacks)."""
        return torch.Generator().manual_seed(self._public_seed(block))

    def _public_seed(self, block: int) -> int:
        return stream_seed(self.cfg.seed, block, 0, _PROBE_SALT)
