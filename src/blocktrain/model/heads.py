"""The autoregressive exit: the last block's next-byte head over the chain of clean streams
(`route = features`), from the context alone: no z and no sampler. It reads the stack as a greedy
block-wise autoregressive model (Belilovsky et al. 2020, arXiv 1901.08164) trained by nothing but
the blocks' own losses. docs/serving.md, "The head exit of a features stack"; BENCHMARKS.md,
"Do blocks compose?", measures it beside the sampler.
"""

from __future__ import annotations

import torch
from torch import nn

from blocktrain.config import ModelConfig
from blocktrain.model.block import Block
from blocktrain.model.cached import KVCache
from blocktrain.model.pipeline import cached_clean_pass
from blocktrain.model.stack import BlockStack

EXITS = ("auto", "sampler", "head")
"""How generation reads a BlockTrain stack (`generate --exit`, the router's `exit`): `sampler`
denoises each span from noise, `head` draws one byte at a time from the last block's next-byte
head, and `auto` (the default) picks one per model (`resolve_exit`)."""


def resolve_exit(exit_: str, model: ModelConfig | None) -> str:
    """The exit `exit_` means for `model` (None: a reference, which has one exit): `auto` is
    `head` for an intervals = reversed route = features stack with next-byte heads (its sweep
    starts at the last block, so it cannot run over a chain of hosts), `sampler` otherwise.
    `sampler` and `head` are kept as given: their refusals are the caller's."""
    if exit_ not in EXITS:
        raise ValueError(f"exit {exit_!r} is not one of {', '.join(EXITS)}")
    if exit_ != "auto":
        return exit_
    reads_head = (
        model is not None
        and model.intervals == "reversed"
        and model.reads_upstream
        and model.aux_weight > 0
    )
    return "head" if reads_head else "sampler"


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


class HeadStage(nn.Module):
    """Block b's clean stream with a key/value cache (no copy of its weights): one stage of the
    head exit's pipeline across hosts, as `ReferenceStage` is of the reference's. Chained over
    the blocks, the last stage's logits are `head_logits` of the context."""

    def __init__(self, block: Block, last: bool) -> None:
        super().__init__()
        if block.aux_head is None or block.aux_norm is None:
            raise ValueError("the block has no next-byte head (the run's aux_weight is 0)")
        self.block, self.last = block, last

    def forward(
        self, x_new: torch.Tensor, upstream: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """x_new (N, L) the new bytes at positions cache.length.. (the cache is extended in
        place); `upstream` (N, L, d) the previous block's clean output (None for block 0) ->
        this block's clean output (N, L, d), or on the last block the head's logits."""
        block = self.block
        h = block.clean_input(x_new, upstream)
        h = cached_clean_pass(list(enumerate(block.layers)), block.rotary, h, cache)
        if self.last:
            assert block.aux_head is not None and block.aux_norm is not None
            return block.aux_head(block.aux_norm(h))
        return h
