"""The end-to-end autoregressive reference (the BlockTrain design, section 2.7, "The end-to-end
reference"): a plain causal byte-level Transformer with B * layers_per_block layers of the blocks'
width, trained with next-byte CE."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, ModelConfig
from blocktrain.model.layers import DualStreamLayer, Rotary
from blocktrain.model.sampling import Sampling, sample_bytes


class Reference(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB_SIZE, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.rotary = Rotary(cfg.head_dim)
        depth_scale = 1.0 / math.sqrt(2 * cfg.layers)
        self.layers = nn.ModuleList(
            DualStreamLayer(
                d, cfg.n_heads, cfg.mlp_ratio, depth_scale, conditioned=False, gates_open=True
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB_SIZE)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x_bytes: torch.Tensor) -> torch.Tensor:
        """x_bytes (N, L) -> logits (N, L, 256); position i predicts byte i + 1."""
        x = self.embed(x_bytes)  # (N, L, d)
        rope = self.rotary.rotation(torch.arange(x_bytes.shape[1], device=x_bytes.device))
        for layer in self.layers:
            x, _ = layer(x, rope)
        return self.head(self.norm(x))


def init_reference(cfg: ModelConfig, seed: int) -> Reference:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + 104729)
        return Reference(cfg)


@torch.no_grad()
def generate_autoregressive(
    model: Callable[[torch.Tensor], torch.Tensor],
    prompt: torch.Tensor,
    n_bytes: int,
    *,
    seq_len: int,
    sampling: Sampling,
    generator: torch.Generator,
) -> torch.Tensor:
    """Continue prompt (N, Lp) by n_bytes, one pass of `model` (x (N, L) -> next-byte logits
    (N, L, 256): the reference, or a stack's head exit, model/heads.py) per byte over the last
    `seq_len` bytes."""
    if prompt.shape[1] == 0:
        raise ValueError("the prompt must hold at least one byte")
    context = prompt
    for _ in range(n_bytes):
        logits = model(context[:, -seq_len:])[:, -1]  # (N, 256)
        new = sample_bytes(logits.cpu(), sampling, generator, prefix=context[:, -3:].cpu())
        new = new.to(context.device)
        context = torch.cat((context, new[:, None]), dim=1)
    return context[:, prompt.shape[1] :]
