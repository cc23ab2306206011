"""Judging an update by its effect (docs/protocol.md, Effect probe): the block's own loss on a
fixed held-out slice, window by window, before and after the update (a paired test); the
first-order gain of its direction against what its magnitudes gain by chance (the gain test);
and a reputation per identity built from those verdicts. The probe is injected (`EffectProbe`;
`training.probe.BlockProbe` implements it): the protocol never imports the model."""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from blocktrain.protocol.core.verdict import Verdict

Tensors = dict[str, torch.Tensor]

REWARD = 0.1
"""Reputation regained by a helpful update (at most 1)."""
PENALTY = 0.5
"""Factor a harmful update multiplies its identity's reputation by."""

BAND_WINDOW = 16
"""Accepted updates per block whose effects describe what an honest update does now."""
BAND_MIN = 4
"""With fewer, the probe judges against zero and the tolerance alone (a run's start, a restart)."""
BAND_WIDTH = 3.0
"""How many robust standard deviations (1.4826 x MAD) above their median the band reaches."""


class EffectProbe(Protocol):
    def window_losses(
        self,
        block: int,
        weights: Tensors,
        others: Mapping[int, Tensors] | None = None,
        draw: int = 0,
    ) -> torch.Tensor:
        """Block `block`'s loss on each window of the held-out slice of draw `draw` with these
        weights, (windows,), deterministic for one draw; `others`: the other blocks' committed
        versions, for blocks that read the blocks before them."""
        ...

    def gradient(
        self,
        block: int,
        weights: Tensors,
        others: Mapping[int, Tensors] | None = None,
        draw: int = 0,
    ) -> Tensors:
        """The gradient of the mean of `window_losses(block, weights, others, draw)` with
        respect to `weights`, tensor by tensor (zeros where a tensor does not move the loss)."""
        ...


@dataclass(frozen=True)
class Effect:
    """The probe's reading of one update: the slice's mean loss before and after, the standard
    error of the relative change, from the windows' paired differences (0 for a probe of one
    window), and the gain test's two numbers (`read`)."""

    before: float
    after: float
    stderr: float = 0.0
    gain: float = 0.0
    """The first-order fall of the slice's loss along the probed step, relative:
    -step x (g . delta) / |before|, g the gradient of the slice's mean loss before."""
    chance: float = 0.0
    """What a delta of the same magnitudes gains by chance: the standard deviation of that fall
    over random signs of the delta's coordinates, step x ||g * delta|| / |before|."""

    @staticmethod
    def paired(before: torch.Tensor, after: torch.Tensor) -> Effect:
        """From per-window losses on the same windows, sigmas and noise: each window's change
        is one paired sample, so the spread between windows (not the spread of the losses
        themselves) sets how surely the update moved the loss."""
        mean_before = float(before.double().mean())
        change = (after.double() - before.double()) / abs(mean_before)
        n = change.numel()
        stderr = float(change.std() / math.sqrt(n)) if n > 1 else 0.0
        return Effect(mean_before, float(after.double().mean()), stderr)

    @staticmethod
    def read(
        before: torch.Tensor,
        after: torch.Tensor,
        gradient: Tensors,
        delta: Tensors,
        step: float,
    ) -> Effect:
        """`paired`, with the gain test's numbers from the gradient before (`EffectProbe.
        gradient`) and the delta the probe applied `step` of."""
        effect = Effect.paired(before, after)
        dot, square = 0.0, 0.0
        for name, d in delta.items():
            terms = gradient[name].double() * d.double()
            dot += float(terms.sum())
            square += float(terms.square().sum())
        scale = step / abs(effect.before)
        return replace(effect, gain=-dot * scale, chance=math.sqrt(square) * scale)

    @property
    def relative(self) -> float:
        return (self.after - self.before) / abs(self.before)

    @property
    def gain_z(self) -> float:
        """The gain in chance standard deviations (0 for a delta that moves nothing). For a
        delta whose signs carry no information about the slice (noise, at any norm and any
        magnitudes), P(gain_z > t) <= exp(-t^2 / 2) (Hoeffding, given the magnitudes)."""
        return self.gain / self.chance if self.chance > 0 else 0.0


@dataclass(frozen=True)
class HonestBand:
    """The relative effects of a block's last BAND_WINDOW accepted updates. It decides only
    whether a refused update costs reputation, never whether one is accepted, so a hostile
    majority can at most narrow it back to the tolerance. Immutable (read outside the lock)."""

    recent: tuple[float, ...] = ()

    def add(self, relative: float) -> HonestBand:
        return HonestBand((*self.recent, relative)[-BAND_WINDOW:])

    @property
    def upper(self) -> float | None:
        """Median + BAND_WIDTH robust standard deviations; None while fewer than BAND_MIN."""
        if len(self.recent) < BAND_MIN:
            return None
        median = statistics.median(self.recent)
        spread = 1.4826 * statistics.median(abs(x - median) for x in self.recent)
        return median + BAND_WIDTH * spread


def judge_effect(
    effect: Effect,
    tolerance: float,
    band: HonestBand | None = None,
    z: float = 0.0,
    gain_z: float = 0.0,
) -> Verdict:
    """Accept an update only if its direction gains more than `gain_z` chance standard deviations
    (`probe_gain_z`) and the slice's loss falls, or rises by less than `z` of its own standard
    errors (`probe_z`; 0: only a fall).

    Both thresholds come from the update itself, so a hostile majority cannot loosen them (while
    the honest band decided acceptance, four tokens on one block wrecked it, +2.0 CE). The gain
    test is what refuses noise: the windows' changes move together, and Gaussian noise read up to
    35 standard errors of fall (bench/honest_spread.py). A refused update costs reputation
    (`harmful`) only past `tolerance` and its block's honest band; otherwise it is `no_gain`, free:
    late in a run an honest delta raises the slice's loss about as often as it lowers it."""
    gained = effect.gain_z > gain_z  # NaN is refused
    lowers = effect.after < effect.before or effect.relative < z * effect.stderr
    if gained and lowers:
        return Verdict.ok()
    upper = None if band is None else band.upper
    limit = tolerance if upper is None else max(tolerance, upper)
    detail = (
        f"the block's held-out loss goes from {effect.before:.5g} to {effect.after:.5g} "
        f"({effect.relative:+.3%} ± {effect.stderr:.3%}; tolerance {tolerance:+.3%}"
        + ("" if upper is None else f", recent accepted updates up to {upper:+.3%}")
        + f"); its direction gains {effect.gain_z:.2f} chance deviations (more than "
        f"{gain_z:g} needed)"
    )
    if not effect.relative <= limit:  # NaN is harmful
        return Verdict.refuse("harmful", detail)
    return Verdict.refuse("no_gain", detail)


def helped(judged: Verdict, effect: Effect) -> bool | None:
    """How a probed update scores its identity's reputation: True when it was accepted and the
    loss fell, False when harmful, None otherwise (a tolerated rise is not a measured gain)."""
    if judged.accepted:
        return True if effect.after < effect.before else None
    return False if judged.reason == "harmful" else None


@dataclass
class Reputation:
    """Each identity's standing in [0, 1], from 1: a harmful update halves it, a helpful one adds
    REWARD. It weights the identity's vote; below `minimum` its updates are refused, but still
    probed, so that a helpful one earns its way back."""

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
    """The probe, and each block's loss and gradient before, computed once per weights objects (a
    commit replaces a block's weights dict, never changes one in place); each new "before" is a new
    draw of the probe's slice."""

    def __init__(self, probe: EffectProbe) -> None:
        self.probe = probe
        self._before: dict[int, tuple[tuple[int, ...], int, torch.Tensor, Tensors]] = {}

    def effect(
        self,
        block: int,
        weights: Tensors,
        delta: Tensors,
        others: Mapping[int, Tensors],
        step: float = 1.0,
    ) -> Effect:
        """The effect of `step` x `delta` on the block's slice (`probe_step`)."""
        key = (id(weights), *(id(others[b]) for b in sorted(others)))
        cached = self._before.get(block)
        if cached is None or cached[0] != key:
            draw = 0 if cached is None else cached[1] + 1
            before = self.probe.window_losses(block, weights, others, draw)
            gradient = self.probe.gradient(block, weights, others, draw)
            cached = self._before[block] = (key, draw, before, gradient)
        _, draw, before, gradient = cached
        after = {k: w.float() + step * delta[k].float() for k, w in weights.items()}
        losses = self.probe.window_losses(block, after, others, draw)
        return Effect.read(before, losses, gradient, delta, step)
