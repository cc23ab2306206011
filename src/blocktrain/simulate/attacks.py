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
    drift     patient: it trains for real and sends 0.9 x its delta plus DRIFT_BIAS of the
              delta's norm on the `bias` coordinate, every round (`DriftingTrainer`); each
              update passes every check of its round, their lean is what `drift` tracks

`Attack.count` attackers, all on `block` (default: where the registry puts them), each with a
token of its own or all under one (`shared_token`: Sybils).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blocktrain.errors import ConfigError
from blocktrain.protocol.core.local_trainer import LocalTrainer

Tensors = dict[str, torch.Tensor]

KINDS = ("shrink", "bias", "noise", "drift")
AT_BOUND = 0.99
"""Forged deltas sit just inside the bound (fp16 rounding must not push them over)."""
MAX_SHRINK = 1.76
BIAS_TENSOR = "head.bias"
DRIFT_BIAS = 0.03
"""The drift attacker's lean: 3 % of its delta's norm on one coordinate (docs/protocol.md,
Drift: flagged within about 10 to 20 rounds at the default threshold)."""


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
    """A `protocol.core.local_trainer.LocalTrainer` that trains nothing and forges its delta
    (every kind but drift)."""

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
            out[bias_target(out)].view(-1)[0] = self.bound
            return out
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.round)
        noise = {k: torch.randn(v.shape, generator=gen) for k, v in w.items()}
        scale = self.bound / _norm(noise)
        return {k: scale * v for k, v in noise.items()}


def bias_target(tensors: Tensors) -> str:
    """The tensor whose first coordinate the bias and drift attackers push."""
    return BIAS_TENSOR if BIAS_TENSOR in tensors else sorted(tensors)[0]


class DriftingTrainer:
    """A real trainer whose delta leans: 0.9 x its own plus DRIFT_BIAS of its norm on one
    coordinate (`bias_target`), within the norm bound as an honest delta is."""

    def __init__(self, honest: LocalTrainer) -> None:
        self.honest = honest
        self.upstream_blocks = honest.upstream_blocks

    def load(self, weights: Tensors) -> None:
        self.honest.load(weights)

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        self.honest.load_upstream(blocks)

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        return self.honest.train(steps, first_step, should_stop)

    def delta(self) -> Tensors:
        honest = self.honest.delta()
        out = {k: 0.9 * v.float() for k, v in honest.items()}
        out[bias_target(out)].view(-1)[0] += DRIFT_BIAS * _norm(honest)
        return out
