"""The autoregressive exit: a block's next-byte head over the chain of clean streams.

Every block's clean stream carries a next-byte head, trained by the auxiliary term of the
block's local loss (training/loss.py). Under `route = features` the clean streams chain (block b
continues blocks 0..b-1), so the last block's head predicts the next byte with the whole stack's
depth, from the context alone: no z and no sampler. It reads the stack as a greedy block-wise
autoregressive model (decoupled greedy learning, Belilovsky et al. 2020, arXiv 1901.08164),
trained by nothing but the blocks' own losses. BENCHMARKS.md, "Do blocks compose?", measures it
beside the sampler.
"""

from __future__ import annotations

import torch

from blocktrain.model.stack import BlockStack


def head_logits(stack: BlockStack, x_bytes: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """x_bytes (N, L) -> logits (N, L, 256) of block `block`'s head (default: the last block);
    position i predicts byte i + 1. The block reads its upstream features as it does in
    training (`BlockStack.upstream`)."""
    index = stack.cfg.blocks - 1 if block is None else block
    module = stack.block(index)
    if module.aux_head is None or module.aux_norm is None:
        raise ValueError(f"block {index} has no next-byte head (the run's aux_weight is 0)")
    stream = module.clean_stream(x_bytes, stack.upstream(index, x_bytes))
    return module.aux_head(module.aux_norm(stream))
