"""What the round engine holds and hands its drivers: a block, a registration, a pull, an
update's content verdict (`Checked`), a commit; the listeners a driver hooks in, and the
accumulator and body limit derived from the settings."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from blocktrain.protocol.core.aggregation import Accumulator
from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.protocol.core.drift import Drifted
from blocktrain.protocol.core.effect import Effect
from blocktrain.protocol.core.influence import InfluenceHistory
from blocktrain.protocol.core.rounds import BlockRounds, RoundClosed, RoundView
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.validation import BlockSpec, Candidate, UpdateMeta
from blocktrain.protocol.core.verdict import Verdict

Tensors = dict[str, torch.Tensor]


def accumulator(settings: AggregatorSettings) -> Accumulator:
    """A round's accumulator: sparse pushes are averaged per coordinate over the votes that
    carry it (docs/protocol.md, Aggregation), the others as before."""
    return Accumulator(settings, per_coordinate=DeltaWire.parse(settings.push_wire).sparse)


@dataclass
class EngineBlock:
    """One block as the engine holds it."""

    index: int
    weights: Tensors
    momentum: Tensors | None
    spec: BlockSpec
    rounds: BlockRounds
    acc: Accumulator
    remainder: Tensors | None = None
    """Exact pulls: what the pull codec left out of the commits so far (`pulls.commit_step`)."""
    influence: InfluenceHistory = field(default_factory=InfluenceHistory)
    """The block's recent changes, the influence bound's reference (in memory: a restart
    starts it again)."""


@dataclass(frozen=True)
class Registered:
    worker: int
    block: int
    view: RoundView
    replaced: tuple[int, ...] = ()
    """The token's older workers this registration retired (max_workers_per_token)."""


@dataclass(frozen=True)
class PullEvent:
    """A pull as the engine saw it: the open round, and whether this pull started its clock."""

    view: RoundView
    started: bool
    local_steps: int | None = None
    """The steps the worker is told to run (`pacing.Pacer`; None when the block is done)."""


@dataclass(frozen=True)
class Checked:
    """An update body after the content checks: the verdict, and what could be read of it."""

    verdict: Verdict
    candidate: Candidate | None
    effect: Effect | None = None
    """The effect probe's reading, when it ran."""
    judged: Verdict | None = None
    """The probe's verdict, when it ran. It is `verdict` unless the identity is excluded: then
    the update is refused all the same, but a helpful one earns reputation back."""

    @property
    def meta(self) -> UpdateMeta | None:
        return None if self.candidate is None else self.candidate.meta


@dataclass(frozen=True)
class ProbeSlot:
    """A place at the effect probe, reserved by `reserve_probe` for one update (None: the
    probe is off, nothing was reserved)."""

    block: int
    round: int
    identity: Hashable


@dataclass(frozen=True)
class Committed:
    """A closed round and the block's weights after it (the old ones when nothing was
    accepted; then `changed` is False). `held` says why a round that accepted updates still
    commits the old weights (the rule refused to aggregate); its new version is written."""

    closed: RoundClosed
    weights: Tensors
    momentum: Tensors | None
    changed: bool
    held: str = ""
    remainder: Tensors | None = None
    """Exact pulls: what the pull codec left out, carried to the next commit."""
    step: Tensors | None = None
    """Exact pulls: the step from the old weights, as the pull codec's parts (None otherwise)."""
    drifted: tuple[Drifted, ...] = ()
    """The identities this round's votes flagged for drift (`drift.DriftTracker`)."""


CommitListener = Callable[[Committed], None]
ReputationListener = Callable[[tuple[str, int], float, float], None]
"""Called with (identity, its new reputation, the time) when an update changed it."""


def max_body_bytes(settings: AggregatorSettings, largest_block_params: int) -> int:
    """The request body limit: the setting, else twice the largest block's fp32 size + 1 MiB."""
    return settings.max_body_bytes or 2 * 4 * largest_block_params + (1 << 20)
