"""Aggregation of one block's accepted deltas (DESIGN.md section 4), over dicts of tensors.

    mean          sum_i w_i t_i delta_i / sum_i w_i t_i   (t_i tokens, w_i staleness factor)
    median        coordinate-wise median of the deltas (unweighted)
    trimmed_mean  per coordinate, drop the floor(trim * n) smallest and largest, average the rest

The result is applied by an outer optimizer. With outer_lr = 1 and no momentum it is plain
averaging, theta + mean delta. With momentum mu it is DiLoCo's outer Nesterov step (Douillard
et al. 2023, arXiv 2311.08105) on the outer gradient g = -delta:

    m <- mu * m + g;   theta <- theta - lr * (g + mu * m)

All arithmetic is fp32 whatever the wire dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensors = dict[str, torch.Tensor]

RULES = ("mean", "median", "trimmed_mean")


def weighted_mean(deltas: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    if not deltas:
        raise ValueError("nothing to aggregate")
    if len(weights) != len(deltas):
        raise ValueError("one weight per delta")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("the weights must sum to a positive number")
    out: Tensors = {}
    for name in deltas[0]:
        acc = torch.zeros_like(deltas[0][name], dtype=torch.float32)
        for delta, w in zip(deltas, weights, strict=True):
            acc.add_(delta[name].float(), alpha=w / total)
        out[name] = acc
    return out


def coordinate_median(deltas: Sequence[Tensors]) -> Tensors:
    """The lower median for an even count (torch.median), a coordinate of one actual delta."""
    if not deltas:
        raise ValueError("nothing to aggregate")
    return {
        name: torch.stack([d[name].float() for d in deltas]).median(dim=0).values
        for name in deltas[0]
    }


def trimmed_mean(deltas: Sequence[Tensors], trim: float) -> Tensors:
    if not deltas:
        raise ValueError("nothing to aggregate")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim = {trim} must lie in [0, 0.5)")
    n = len(deltas)
    k = math.floor(trim * n)
    out: Tensors = {}
    for name in deltas[0]:
        stacked = torch.stack([d[name].float() for d in deltas])
        if k:
            stacked = stacked.sort(dim=0).values[k : n - k]
        out[name] = stacked.mean(dim=0)
    return out


class Accumulator:
    """Collects one round's accepted deltas. The mean needs only a running weighted sum (one
    fp32 copy of the block, however many replicas); the robust rules keep every delta."""

    def __init__(self, rule: str = "mean", trim: float = 0.1) -> None:
        if rule not in RULES:
            raise ValueError(f"aggregation rule {rule!r} is not one of {', '.join(RULES)}")
        self.rule = rule
        self.trim = trim
        self.count = 0
        self.total_weight = 0.0
        self._sum: Tensors | None = None
        self._kept: list[Tensors] = []

    def add(self, delta: Tensors, weight: float) -> None:
        """Add a delta with its weight (tokens x staleness factor; ignored by robust rules)."""
        if not weight > 0:
            raise ValueError("a delta's weight must be positive")
        self.count += 1
        self.total_weight += weight
        if self.rule == "mean":
            if self._sum is None:
                self._sum = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in delta.items()}
            for name, value in delta.items():
                self._sum[name].add_(value.float(), alpha=weight)
        else:
            self._kept.append(delta)

    def result(self) -> Tensors | None:
        """The aggregated delta, or None when nothing was added."""
        if self.count == 0:
            return None
        if self.rule == "mean":
            assert self._sum is not None
            return {k: v / self.total_weight for k, v in self._sum.items()}
        if self.rule == "median":
            return coordinate_median(self._kept)
        return trimmed_mean(self._kept, self.trim)


@dataclass(frozen=True)
class OuterOptimizer:
    """How the aggregated delta moves the block's weights."""

    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr = {self.lr} must be positive")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum = {self.momentum} must lie in [0, 1)")

    @property
    def stateful(self) -> bool:
        return self.momentum > 0

    def apply(
        self, weights: Tensors, delta: Tensors, buffer: Tensors | None = None
    ) -> tuple[Tensors, Tensors | None]:
        """(new weights, new momentum buffer); inputs are not modified."""
        new_weights: Tensors = {}
        new_buffer: Tensors | None = {} if self.stateful else None
        for name, theta in weights.items():
            g = -delta[name].float()
            if self.stateful:
                assert new_buffer is not None
                prev = (
                    buffer[name] if buffer is not None and name in buffer else torch.zeros_like(g)
                )
                m = prev.float() * self.momentum + g
                new_buffer[name] = m
                step = g + self.momentum * m if self.nesterov else m
            else:
                step = g
            new_weights[name] = theta.float() - self.lr * step
        return new_weights, new_buffer
