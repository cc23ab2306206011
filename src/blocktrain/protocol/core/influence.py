"""Influence bounded up front (docs/protocol.md, Aggregation, "The influence bound"): under the
`mean` rule no identity's term in a round's aggregate may exceed `max_influence` (f) times the
median of the block's last INFLUENCE_WINDOW recorded changes, tensor by tensor, a reference no
round's votes can move (the clip of `aggregation.clip_scales` is relative to the round's own
median, which a hostile majority sets):

    share_i x s_i x ||v_i[t]|| <= f x R[t]

What is recorded is each round's aggregate before this cut, at most INFLUENCE_GROWTH x R[t]: a
reference fed by the cut steps would shrink with every round in a block of one or two honest
identities (a lone identity's term is the whole change) and starve it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Tensors = dict[str, torch.Tensor]

INFLUENCE_WINDOW = 8
"""Committed changes per block whose median is the reference; with fewer (a run's start, a
restart: the history is in memory) votes are clipped by `clip` and the norm bound alone."""
INFLUENCE_GROWTH = 1.5
"""A change is recorded as at most this many times the reference it was made under, so that
votes that keep the bound at its edge raise it by at most 1.5x per 5 rounds (a median of 8
moves once 5 entries do), whoever sends them."""


@dataclass(frozen=True)
class InfluenceHistory:
    """One block's recorded change norms, tensor by tensor (immutable: a commit replaces it)."""

    recent: tuple[Mapping[str, float], ...] = ()

    def reference(self) -> dict[str, float] | None:
        """R[t], the median of the last INFLUENCE_WINDOW recorded norms of each tensor; None
        while fewer are recorded."""
        if len(self.recent) < INFLUENCE_WINDOW:
            return None
        return {name: statistics.median(r[name] for r in self.recent) for name in self.recent[0]}

    def add(self, norms: Mapping[str, float]) -> InfluenceHistory:
        """The history after a committed change of these norms (capped by the growth bound)."""
        ref = self.reference()
        entry = {
            k: v if ref is None else min(v, INFLUENCE_GROWTH * ref[k]) for k, v in norms.items()
        }
        return InfluenceHistory((*self.recent, entry)[-INFLUENCE_WINDOW:])

    @property
    def size(self) -> float | None:
        """The reference of the whole block, sqrt(sum_t R[t]^2), as `/v1/status` shows it."""
        ref = self.reference()
        return None if ref is None else math.sqrt(sum(r * r for r in ref.values()))


def norms(delta: Tensors) -> dict[str, float]:
    return {k: float(torch.linalg.vector_norm(t, dtype=torch.float32)) for k, t in delta.items()}


def term_norms(
    votes: Sequence[Tensors], weights: Sequence[float], *, per_coordinate: bool = False
) -> list[dict[str, float]]:
    """||term of vote i in the weighted mean||, unscaled, per tensor: share_i x ||v_i[t]||, or
    for sparse votes ||w_i v_i[t] / carried[t]||, carried the weight of the votes that carry
    each coordinate (`aggregation.weighted_mean`)."""
    total = float(sum(weights))
    out: list[dict[str, float]] = [{} for _ in votes]
    for name in votes[0]:
        if not per_coordinate:
            for terms, v, w in zip(out, votes, weights, strict=True):
                terms[name] = w / total * float(torch.linalg.vector_norm(v[name].float()))
            continue
        carried = torch.zeros_like(votes[0][name], dtype=torch.float32)
        for v, w in zip(votes, weights, strict=True):
            carried.add_(v[name] != 0, alpha=w)
        for terms, v, w in zip(out, votes, weights, strict=True):
            share = torch.where(carried > 0, w / carried.clamp(min=1e-30), 0.0)
            terms[name] = float(torch.linalg.vector_norm(v[name].float() * share))
    return out


def influence_scales(
    terms: Sequence[Mapping[str, float]],
    reference: Mapping[str, float],
    fraction: float,
    scales: Sequence[Mapping[str, float]] | None = None,
) -> list[dict[str, float]] | None:
    """Per vote and tensor, the factor (at most its `scales` one) that keeps its term within
    fraction x reference; None when no vote needs cutting. A tensor whose reference is 0 keeps its
    `scales` factor: a zero bound would freeze it for good."""
    out: list[dict[str, float]] = []
    cut = False
    for i, vote_terms in enumerate(terms):
        factors: dict[str, float] = {}
        for name, term in vote_terms.items():
            base = 1.0 if scales is None else scales[i][name]
            bound = fraction * reference[name]
            if bound > 0 and term * base > bound:
                factors[name], cut = bound / term, True
            else:
                factors[name] = base
        out.append(factors)
    return out if cut else None
