"""Forged deltas (`shrink`, `bias`, `noise`): made from the pulled weights at the aggregator's norm
bound (a forged delta must pass the validators to do harm), claiming the largest token count it
accepts."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Tensors = dict[str, torch.Tensor]

AT_BOUND = 0.99  # just inside the bound: fp16 rounding must not push a forged delta over
MAX_SHRINK = 1.76
BIAS_TENSOR = "head.bias"


def norm(tensors: Tensors) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors.values()))


class ForgingTrainer:
    """A `protocol.core.local_trainer.LocalTrainer` that trains nothing and forges its delta."""

    def __init__(self, kind: str, bound: float, tokens: int, seed: int) -> None:
        self.kind = kind
        self.upstream_blocks: list[int] = []  # it reads nothing from other blocks
        self.bound = AT_BOUND * bound
        self.tokens = tokens
        self.seed = seed
        self.weights: Tensors = {}
        self.round = 0

    def load(self, weights: Tensors) -> None:
        self.weights = {k: v.float() for k, v in weights.items()}

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        pass

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        self.round = first_step // max(steps, 1)  # the version it trained from (version x H)
        return {"tokens": float(self.tokens), "loss": math.nan, "steps": 0.0}

    def delta(self) -> Tensors:
        w = self.weights
        if self.kind == "shrink":
            s = min(MAX_SHRINK, self.bound / norm(w))
            return {k: -s * v for k, v in w.items()}
        if self.kind == "bias":
            out = {k: torch.zeros_like(v) for k, v in w.items()}
            target = BIAS_TENSOR if BIAS_TENSOR in out else sorted(out)[0]
            out[target].view(-1)[0] = self.bound
            return out
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.round)
        noise = {k: torch.randn(v.shape, generator=gen) for k, v in w.items()}
        scale = self.bound / norm(noise)
        return {k: scale * v for k, v in noise.items()}
