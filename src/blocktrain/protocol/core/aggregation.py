"""Aggregation of one block's accepted deltas (docs/protocol.md, "Aggregation"): votes (one per
identity under `weighting = "identity"`, so a token's many workers count once), clipping (and,
under `mean`, the influence bound), then the rule:

    mean           sum_i w_i v_i / sum_i w_i (w_i: staleness x reputation x steps share); for
                   sparse votes per coordinate over the votes that carry it
    median         coordinate-wise median of the votes (unweighted)
    trimmed_mean   per coordinate, drop k = max(tolerate, ceil(trim * n)) at each end
    centered_clip  Karimireddy et al. 2021 (arXiv 2012.10333), from the coordinate median

`median` and `trimmed_mean` commit no change when n <= 2 * tolerate (`Aggregate.held`). The
outer optimizer is DiLoCo's Nesterov step on g = -delta (plain averaging with lr 1 and no
momentum). All arithmetic is fp32 whatever the wire dtype."""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from blocktrain.protocol.core.influence import influence_scales, norms, term_norms

Tensors = dict[str, torch.Tensor]

RULES = ("mean", "median", "trimmed_mean", "centered_clip")
WEIGHTINGS = ("identity", "reported")
CENTERED_CLIP_ITERS = 3


def weighted_mean(
    deltas: Sequence[Tensors],
    weights: Sequence[float],
    scales: Sequence[dict[str, float]] | None = None,
    *,
    per_coordinate: bool = False,
) -> Tensors:
    """sum_i w_i v_i / sum_i w_i in fp32, each tensor of v_i scaled by its factor in `scales`
    (clipping folded in: no scaled copy is made). `per_coordinate` (sparse votes): each coordinate
    is divided by the weight of the votes that carry it (non-zero there), not by all the weight."""
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
        carried = torch.zeros_like(acc) if per_coordinate else None
        for i, (delta, w) in enumerate(zip(deltas, weights, strict=True)):
            scale = 1.0 if scales is None else scales[i][name]
            if carried is None:
                acc.add_(delta[name], alpha=w / total * scale)  # fp16 in, summed in fp32
            else:
                acc.add_(delta[name], alpha=w * scale)
                carried.add_(delta[name] != 0, alpha=w)
        if carried is not None:
            acc = torch.where(carried > 0, acc / carried.clamp(min=1e-30), 0.0)
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


def trim_count(n: int, trim: float, tolerate: int = 0) -> int:
    """Values dropped at each end of a coordinate: at least `tolerate`, and ceil(trim * n), so
    that a positive trim trims at every n (floor(0.1 * n) trimmed nothing below 10)."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim = {trim} must lie in [0, 0.5)")
    return max(tolerate, math.ceil(trim * n - 1e-9))


def trimmed_mean(deltas: Sequence[Tensors], trim: float, tolerate: int = 0) -> Tensors:
    if not deltas:
        raise ValueError("nothing to aggregate")
    n = len(deltas)
    k = trim_count(n, trim, tolerate)
    if n <= 2 * k:
        raise ValueError(f"trimming {k} at each end needs more than {2 * k} deltas, not {n}")
    out: Tensors = {}
    for name in deltas[0]:
        stacked = torch.stack([d[name].float() for d in deltas])
        if k:
            stacked = stacked.sort(dim=0).values[k : n - k]
        out[name] = stacked.mean(dim=0)
    return out


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float32))


def clip_scales(votes: Sequence[Tensors], c: float) -> list[dict[str, float]]:
    """Per vote and tensor, the factor that brings the tensor to at most c x that tensor's
    median norm over the votes (1 for those within it)."""
    scales: list[dict[str, float]] = [{} for _ in votes]
    for name in votes[0]:
        norms = [_norm(v[name]) for v in votes]
        bound = c * statistics.median(norms)
        for factors, norm in zip(scales, norms, strict=True):
            factors[name] = bound / norm if norm > bound else 1.0
    return scales


def clip_to_median(votes: Sequence[Tensors], c: float) -> list[Tensors]:
    """Each vote scaled, per tensor, to at most c x that tensor's median norm over the votes."""
    return [
        {name: t.float() * factors[name] for name, t in v.items()}
        for v, factors in zip(votes, clip_scales(votes, c), strict=True)
    ]


def centered_clip(votes: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    """Centered clipping from the coordinate median, with the median distance as radius."""
    center = coordinate_median(votes)

    def distance(v: Tensors) -> float:
        return math.sqrt(sum(_norm(v[k].float() - center[k]) ** 2 for k in center))

    tau = statistics.median(distance(v) for v in votes)
    total = float(sum(weights))
    for _ in range(CENTERED_CLIP_ITERS):
        step = {k: torch.zeros_like(t) for k, t in center.items()}
        for v, w in zip(votes, weights, strict=True):
            d = distance(v)
            scale = min(1.0, tau / d) if d > 0 else 0.0
            for k in center:
                step[k].add_(v[k].float() - center[k], alpha=scale * w / total)
        center = {k: center[k] + step[k] for k in center}
    return center


class AggregationPolicy(Protocol):
    """The aggregation fields of `settings.AggregatorSettings`, where each is documented."""

    @property
    def rule(self) -> str: ...
    @property
    def trim(self) -> float: ...
    @property
    def tolerate(self) -> int: ...
    @property
    def clip(self) -> float: ...
    @property
    def weighting(self) -> str: ...
    @property
    def max_influence(self) -> float: ...


@dataclass(frozen=True)
class Policy:
    """A plain `AggregationPolicy` (the settings are one, too)."""

    rule: str = "mean"
    trim: float = 0.1
    tolerate: int = 1
    clip: float = 2.0
    weighting: str = "identity"
    max_influence: float = 0.5


@dataclass(frozen=True)
class Entry:
    """One accepted update as the accumulator keeps it."""

    delta: Tensors
    identity: Hashable
    weight: float
    """Staleness factor x the identity's reputation."""
    tokens: int
    """As reported by the worker: read only by the `reported` weighting."""
    effect: float | None = None
    """The effect probe's relative change of the block's held-out loss (None: not probed);
    read only by the drift tracker."""


@dataclass(frozen=True)
class Aggregate:
    """A round's aggregated delta, or None with the reason (`held`) when it was refused."""

    delta: Tensors | None
    held: str = ""
    votes: int = 0
    uncapped: dict[str, float] | None = None
    """Each tensor's norm of the aggregate before the influence clip, which the block's
    `influence.InfluenceHistory` records (None when nothing was aggregated)."""


class Accumulator:
    """Collects one round's accepted updates under their update ids until the round closes (so
    that `discard` can take a revoked identity's back out). `per_coordinate`: the votes are sparse,
    and their means are taken per coordinate (`weighted_mean`)."""

    def __init__(
        self, policy: AggregationPolicy | None = None, *, per_coordinate: bool = False
    ) -> None:
        self.policy = policy or Policy()
        self.per_coordinate = per_coordinate
        if self.policy.rule not in RULES:
            raise ValueError(f"aggregation rule {self.policy.rule!r} is not one of {RULES}")
        if self.policy.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting {self.policy.weighting!r} is not one of {WEIGHTINGS}")
        self.entries: dict[int, Entry] = {}

    @property
    def count(self) -> int:
        return len(self.entries)

    def add(
        self,
        update_id: int,
        delta: Tensors,
        *,
        identity: Hashable,
        weight: float = 1.0,
        tokens: int = 1,
        effect: float | None = None,
    ) -> None:
        if update_id in self.entries:
            raise ValueError(f"update {update_id} is already in the round")
        if not weight > 0 or not tokens > 0:
            raise ValueError("an update's weight and tokens must be positive")
        self.entries[update_id] = Entry(delta, identity, weight, tokens, effect)

    def discard(self, update_ids: Iterable[int]) -> list[int]:
        """Remove these updates (ids not held are ignored); returns the ids removed."""
        removed = [u for u in update_ids if self.entries.pop(u, None) is not None]
        return removed

    def _groups(self) -> dict[Hashable, list[Entry]]:
        groups: dict[Hashable, list[Entry]] = {}
        for e in self.entries.values():
            groups.setdefault(e.identity, []).append(e)
        return groups

    def effects(self) -> list[float | None]:
        """Each identity's mean probe effect, in `by_identity`'s order (None: one of its
        updates was not probed)."""
        out: list[float | None] = []
        for group in self._groups().values():
            known = [e.effect for e in group if e.effect is not None]
            out.append(sum(known) / len(known) if len(known) == len(group) else None)
        return out

    def by_identity(self) -> tuple[list[Hashable], list[Tensors], list[float]]:
        """(identities, their votes, their weights) under the identity weighting: each
        identity's updates averaged into one vote (the drift tracker reads these whatever the
        weighting)."""
        groups = self._groups()
        votes, weights = [], []
        for group in groups.values():
            ws = [e.weight for e in group]
            votes.append(
                group[0].delta
                if len(group) == 1
                else weighted_mean([e.delta for e in group], ws, per_coordinate=self.per_coordinate)
            )
            weights.append(sum(ws) / len(ws))
        return list(groups), votes, weights

    def votes(self) -> tuple[list[Tensors], list[float]]:
        """(votes, their weights) under the policy's weighting (step 1)."""
        if self.policy.weighting == "reported":
            entries = list(self.entries.values())
            return [e.delta for e in entries], [e.weight * e.tokens for e in entries]
        _, votes, weights = self.by_identity()
        return votes, weights

    def result(self, reference: dict[str, float] | None = None) -> Aggregate:
        """The aggregated delta (None when nothing was added, or when the rule refuses);
        `reference`: the block's `InfluenceHistory.reference`, for the influence clip."""
        if not self.entries:
            return Aggregate(None)
        p = self.policy
        votes, weights = self.votes()
        n = len(votes)
        if p.rule == "mean":  # clipping folded into the sum: no fp32 copy of each vote
            scales = clip_scales(votes, p.clip) if p.clip > 0 else None
            mean = weighted_mean(votes, weights, scales, per_coordinate=self.per_coordinate)
            if reference is None or p.max_influence <= 0:
                return Aggregate(mean, votes=n, uncapped=norms(mean))
            terms = term_norms(votes, weights, per_coordinate=self.per_coordinate)
            capped = influence_scales(terms, reference, p.max_influence, scales)
            if capped is None:  # no vote was cut
                return Aggregate(mean, votes=n, uncapped=norms(mean))
            bounded = weighted_mean(votes, weights, capped, per_coordinate=self.per_coordinate)
            return Aggregate(bounded, votes=n, uncapped=norms(mean))
        if p.clip > 0:
            votes = clip_to_median(votes, p.clip)
        if p.rule in ("median", "trimmed_mean"):
            k = p.tolerate if p.rule == "median" else trim_count(n, p.trim, p.tolerate)
            if n <= 2 * k:
                held = (
                    f"{p.rule} tolerating {k} attacker(s) needs more than {2 * k} votes; "
                    f"{n} came ({self.count} update(s)): no change committed"
                )
                return Aggregate(None, held, n)
            if p.rule == "median":
                delta = coordinate_median(votes)
            else:
                delta = trimmed_mean(votes, p.trim, p.tolerate)
        else:
            delta = centered_clip(votes, weights)
        return Aggregate(delta, votes=n, uncapped=norms(delta))


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
