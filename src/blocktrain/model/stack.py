"""The blocks a process holds: `BlockStack` (all of them, or a worker's one, with the frozen
target table E) and `init_block`. Every caller runs a block through `BlockStack.denoise`, so that
under `route = features` it reads the clean streams of the blocks before it.
"""

from __future__ import annotations

import torch
from torch import nn

from blocktrain.config import ModelConfig
from blocktrain.model.block import Block, ZLayout, target_table


def init_block(cfg: ModelConfig, seed: int, index: int) -> Block:
    """Block `index` initialised from (seed, index) alone, so a worker that builds only its
    block gets bit-for-bit the same initial weights as a process that builds all of them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + 7919 * (index + 1))
        return Block(cfg)


class BlockStack(nn.Module):
    """The blocks a process holds (all of them, or a worker's one) and the frozen table E."""

    targets: torch.Tensor  # (256, d), a buffer: saved with the weights, never trained

    def __init__(self, cfg: ModelConfig, seed: int, blocks: list[int] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.block_ids = list(range(cfg.blocks)) if blocks is None else sorted(blocks)
        self.blocks = nn.ModuleDict({str(b): init_block(cfg, seed, b) for b in self.block_ids})
        self.register_buffer("targets", target_table(seed, cfg.d_model))
        # The last context's upstream chain (`upstream`); the tensor is held so its id stays its.
        self._upstream_memo: tuple[tuple[object, ...], torch.Tensor, list[torch.Tensor]] | None = (
            None
        )

    def block(self, index: int) -> Block:
        module = self.blocks[str(index)]
        assert isinstance(module, Block)
        return module

    def has_all_blocks(self) -> bool:
        return self.block_ids == list(range(self.cfg.blocks))

    def denoise(
        self,
        index: int,
        x_bytes: torch.Tensor,
        z: torch.Tensor,
        sigma: torch.Tensor,
        layout: ZLayout,
        *,
        with_aux: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block `index`'s forward pass with what it reads from the blocks before it
        (`upstream`): how every caller of a held block runs it."""
        upstream = self.upstream(index, x_bytes)
        return self.block(index)(x_bytes, z, sigma, layout, with_aux=with_aux, upstream=upstream)

    @torch.no_grad()
    def upstream(self, index: int, x_bytes: torch.Tensor) -> torch.Tensor | None:
        """What block `index` reads besides z: None under `route = state`; under `route =
        features`, the clean stream of blocks 0..index-1 run in turn on x_bytes (N, Lx), with no
        gradient, so no block's loss reaches another's weights. The sampler's calls on one
        context share it: the last chain is kept, keyed by the tensor, its version and the
        blocks' parameter versions."""
        if self.cfg.route == "state" or index == 0:
            return None
        missing = [b for b in range(index) if b not in self.block_ids]
        if missing:
            raise ValueError(  # the callers refuse such a set of blocks first (Trainer.create)
                f"block {index} reads the clean streams of blocks 0..{index - 1} (route = "
                f"features), and this process does not hold block(s) {missing}"
            )
        key = (id(x_bytes), x_bytes._version, tuple(x_bytes.shape), self._versions(index))
        memo = self._upstream_memo
        if memo is None or memo[0] != key:
            memo = self._upstream_memo = (key, x_bytes, [])
        chain = memo[2]
        while len(chain) < index:
            chain.append(self.block(len(chain)).clean_stream(x_bytes, chain[-1] if chain else None))
        return chain[index - 1]

    def _versions(self, index: int) -> tuple[int, ...]:
        return tuple(p._version for b in range(index) for p in self.block(b).parameters())
