"""Pacing (docs/protocol.md, Pacing): the local steps each worker is told at a pull.

`fixed`: H = `local_steps` for everyone. `adaptive`: a worker's pace is the median of its last
KEEP readings of (push time - pull time) / steps, which includes its transfers, so sized steps
fit the whole round trip; a pull with `left` seconds to the deadline tells it h =
floor(pacing_margin x left / pace), clamped to [`fewest_steps(H)`, H] (H before any reading).
An update may not declare more steps than its pull was told (`bad_metadata`); one that declares
none counts as H. An accepted vote weighs steps / H, as fewer tokens do in FedAvg's mean."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from blocktrain.protocol.core.rounds import NOT_A_REPORT
from blocktrain.protocol.core.validation import UpdateMeta
from blocktrain.protocol.core.verdict import Verdict

PACINGS = ("fixed", "adaptive")
KEEP = 5
"""Readings of seconds per step kept per worker; their median is its pace."""
FEWEST_SHARE = 8
"""An adaptively paced worker runs at least H // FEWEST_SHARE steps (and at least 1)."""


class PacingPolicy(Protocol):
    """The pacing fields of `settings.AggregatorSettings`, where each is documented."""

    @property
    def local_steps(self) -> int: ...
    @property
    def pacing(self) -> str: ...
    @property
    def pacing_margin(self) -> float: ...


def fewest_steps(local_steps: int) -> int:
    """The fewest steps adaptive pacing tells a worker: H // 8, at least 1."""
    return max(1, local_steps // FEWEST_SHARE)


def fit_steps(local_steps: int, margin: float, left: float, pace: float) -> int:
    """The steps that take `margin` of `left` seconds at `pace` seconds each, within
    [fewest_steps(H), H]."""
    fits = math.floor(margin * max(0.0, left) / pace) if pace > 0 else local_steps
    return max(fewest_steps(local_steps), min(local_steps, fits))


def steps_share(steps: int | None, local_steps: int) -> float:
    """The weight factor of an update of `steps` local steps: steps / H (1 when undeclared)."""
    return 1.0 if steps is None else min(1.0, steps / local_steps)


def declared_steps(metadata: Mapping[str, str]) -> int | None:
    """The `steps` an accepted body's `__metadata__` declares (it was validated), if any."""
    value = metadata.get("steps")
    return None if value is None else int(value.strip())


@dataclass(frozen=True)
class Told:
    """What a worker's last pull was told: the block and round, when, and the steps."""

    block: int
    round: int
    at: float
    steps: int


class Pacer:
    """Each worker's measured pace and the steps its last pull was told (in memory)."""

    def __init__(self, policy: PacingPolicy) -> None:
        self.policy = policy
        self.readings: dict[int, deque[float]] = {}
        """worker -> its last KEEP readings of seconds per step."""
        self.told: dict[int, Told] = {}

    @property
    def adaptive(self) -> bool:
        return self.policy.pacing == "adaptive"

    def pace(self, worker: int) -> float | None:
        """The worker's seconds per step: the median of its recent readings (None: none yet)."""
        readings = self.readings.get(worker)
        return statistics.median(readings) if readings else None

    def steps_for(self, worker: int, left: float | None) -> int:
        """The steps to tell `worker` with `left` seconds to the deadline (None: no deadline)."""
        h = self.policy.local_steps
        pace = self.pace(worker)
        if not self.adaptive or left is None or pace is None:
            return h
        return fit_steps(h, self.policy.pacing_margin, left, pace)

    def pulled(
        self, worker: int, block: int, round: int, now: float, deadline: float | None
    ) -> int:
        """`worker` pulled `round` of `block` at `now`: the steps it is told, remembered."""
        steps = self.steps_for(worker, None if deadline is None else deadline - now)
        self.told[worker] = Told(block, round, now, steps)
        return steps

    def allowed(self, worker: int, block: int, round: int) -> int:
        """The most steps an update of `worker` for `round` of `block` may declare."""
        told = self.told.get(worker)
        if told is None or (told.block, told.round) != (block, round):
            return self.policy.local_steps
        return told.steps

    def check(self, worker: int, block: int, meta: UpdateMeta) -> Verdict:
        """Refused `bad_metadata` when the update declares more steps than it was told."""
        allowed = self.allowed(worker, block, meta.round)
        if meta.steps is not None and meta.steps > allowed:
            return Verdict.refuse(
                "bad_metadata",
                f"the update declares {meta.steps} local steps; worker {worker} was told "
                f"{allowed} for round {meta.round}",
            )
        return Verdict.ok()

    def steps_of(self, meta: UpdateMeta) -> int:
        """The steps an update took: those it declares, else H (it predates pacing)."""
        h = self.policy.local_steps
        return h if meta.steps is None else min(meta.steps, h)

    def share(self, meta: UpdateMeta) -> float:
        """The weight factor of the update's vote: steps / H."""
        return steps_share(self.steps_of(meta), self.policy.local_steps)

    def observe(
        self, worker: int, block: int, meta: UpdateMeta, verdict: Verdict, now: float
    ) -> None:
        """A judged push of `worker`: a reading of its pace when it is the first report for the
        round its last pull was told (the time from that pull to `now`, over its steps)."""
        told = self.told.get(worker)
        if verdict.reason in NOT_A_REPORT or told is None:
            return
        if (told.block, told.round) != (block, meta.round):
            return
        del self.told[worker]
        elapsed = now - told.at
        if elapsed > 0:
            readings = self.readings.setdefault(worker, deque(maxlen=KEEP))
            readings.append(elapsed / self.steps_of(meta))

    def forget(self, worker: int) -> None:
        """The worker left: its readings and its last pull go."""
        self.readings.pop(worker, None)
        self.told.pop(worker, None)
