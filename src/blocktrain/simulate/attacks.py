"""Hostile workers for the simulator (BENCHMARKS.md, Poisoning; `bench/adversarial.py`).

An attacker is a virtual worker like any other (it registers, pulls, pushes on the virtual
clock) whose trainer forges its delta from the weights it pulled, at the aggregator's norm
bound (a forged delta must pass the validators to do harm), and claims the largest token count
the aggregator accepts (which bought weight under the old token-weighted mean):

    shrink    -s x the block's weights, s as large as the bound allows (at most 1.76: the
              issue's "-0.76x its weights")
    bias      one coordinate at the bound, zeros elsewhere: the logit bias of byte 0 in the
              block's output head (`head.bias`), else the first coordinate of the first tensor
    noise     Gaussian noise scaled to the bound, fresh each round

`Attack.count` attackers, all on `block` (default: where the registry puts them), each with a
token of its own or all under one (`shared_token`: Sybils).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blocktrain.errors import ConfigError

Tensors = dict[str, torch.Tensor]

KINDS = ("shrink", "bias", "noise")
AT_BOUND = 0.99
"""Forged deltas sit just inside the bound (fp16 rounding must not push them over)."""
MAX_SHRINK = 1.76
BIAS_TENSOR = "head.bias"


def _norm(tensors: Tensors) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors.values()))


@dataclass(frozen=True)
class Attack:
    """Who attacks, and how."""

    kind: str
    count: int = 1
    block: int | None = None
    shared_token: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"attack {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.count <= 0:
            raise ConfigError(f"attack {self.kind}: count must be positive")

    @staticmethod
    def parse(text: str) -> Attack:
        """`KIND[:COUNT[:BLOCK]][:shared]`, e.g. `shrink`, `noise:4:0`, `shrink:4:shared`."""
        parts = [p.strip() for p in text.split(":")]
        shared = parts[-1] == "shared"
        if shared:
            parts = parts[:-1]
        if not parts or len(parts) > 3:
            raise ConfigError(f"--attack {text!r}: expected KIND[:COUNT[:BLOCK]][:shared]")
        try:
            numbers = [int(p) for p in parts[1:]]
        except ValueError:
            raise ConfigError(f"--attack {text!r}: COUNT and BLOCK are integers") from None
        count = numbers[0] if numbers else 1
        block = numbers[1] if len(numbers) > 1 else None
        return Attack(parts[0], count, block, shared)

    def token(self, i: int) -> int:
        """The identity attacker i speaks for (distinct from every honest worker's)."""
        return -1 if self.shared_token else -1 - i


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
            s = min(MAX_SHRINK, self.bound / _norm(w))
            return {k: -s * v for k, v in w.items()}
        if self.kind == "bias":
            out = {k: torch.zeros_like(v) for k, v in w.items()}
            target = BIAS_TENSOR if BIAS_TENSOR in out else sorted(out)[0]
            out[target].view(-1)[0] = self.bound
            return out
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.round)
        noise = {k: torch.randn(v.shape, generator=gen) for k, v in w.items()}
        scale = self.bound / _norm(noise)
        return {k: scale * v for k, v in noise.items()}
