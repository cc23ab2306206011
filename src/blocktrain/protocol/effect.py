"""Judging an update by its effect (docs/protocol.md, Effect probe): the block's own loss on a
fixed held-out slice, before and after the update, and a reputation per identity built from
those verdicts.

The protocol never imports the model, so the probe is injected: `EffectProbe` is the type, and
`training.probe.BlockProbe` the implementation that `cli/aggregator.py` and the simulator wire
in. It is pure in (block, weights, delta): fixed batch, fixed noise, fixed sigmas.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from blocktrain.protocol.verdict import Verdict

Tensors = dict[str, torch.Tensor]

REWARD = 0.1
"""Reputation regained by a helpful update (at most 1)."""
PENALTY = 0.5
"""Factor a harmful update multiplies its identity's reputation by."""


class EffectProbe(Protocol):
    def loss(self, block: int, weights: Tensors) -> float:
        """Block `block`'s loss on the fixed held-out slice with these weights (deterministic)."""
        ...


@dataclass(frozen=True)
class Effect:
    """The probe's reading of one update."""

    before: float
    after: float

    @property
    def relative(self) -> float:
        return (self.after - self.before) / abs(self.before)


def judge_effect(effect: Effect, tolerance: float) -> Verdict:
    """Refuse an update that raises the loss by more than `tolerance` (relative): `harmful`,
    which costs reputation; or that does not lower it at all: `no_gain`, which costs nothing
    (an honest update late in a run may be noise) but keeps votes that do nothing from
    diluting those that train, e.g. a majority shrinking a block whose output is still zero."""
    detail = (
        f"the block's held-out loss goes from {effect.before:.5g} to {effect.after:.5g} "
        f"({effect.relative:+.3%}; tolerance {tolerance:+.3%})"
    )
    if not effect.relative <= tolerance:  # NaN is harmful too
        return Verdict.refuse("harmful", detail)
    if not effect.after < effect.before:
        return Verdict.refuse("no_gain", detail)
    return Verdict.ok()


@dataclass
class Reputation:
    """Each identity's standing in [0, 1], from 1: a harmful update halves it, a helpful one
    adds REWARD. It weights the identity's vote, and below `minimum` it is refused outright."""

    minimum: float
    scores: dict[Hashable, float] = field(default_factory=dict)

    def of(self, identity: Hashable) -> float:
        return self.scores.get(identity, 1.0)

    def excluded(self, identity: Hashable) -> Verdict:
        score = self.of(identity)
        if score < self.minimum:
            return Verdict.refuse(
                "low_reputation",
                f"reputation {score:.3g} is below {self.minimum:.3g} after harmful updates",
            )
        return Verdict.ok()

    def observe(self, identity: Hashable, helpful: bool) -> bool:
        """Score one judged update; whether the identity's reputation changed (a helpful update
        of an identity at 1 does not change it)."""
        score = self.of(identity)
        new = min(1.0, score + REWARD) if helpful else score * PENALTY
        self.scores[identity] = new
        return new != score


class ProbeCache:
    """The probe and each block's loss before, computed once per weights object (a commit
    replaces the block's weights dict and never changes one in place, so every update of a
    round is compared with the same number)."""

    def __init__(self, probe: EffectProbe) -> None:
        self.probe = probe
        self._before: dict[int, tuple[Tensors, float]] = {}

    def effect(self, block: int, weights: Tensors, delta: Tensors) -> Effect:
        cached = self._before.get(block)
        if cached is None or cached[0] is not weights:
            cached = self._before[block] = (weights, self.probe.loss(block, weights))
        after = {k: w.float() + delta[k].float() for k, w in weights.items()}
        return Effect(cached[1], self.probe.loss(block, after))
