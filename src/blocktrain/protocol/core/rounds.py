"""Rounds and deadlines (docs/protocol.md, "Rounds"): the pure state machine of one block.
Every method that depends on time takes `now`, so the aggregator, the simulator and the tests
drive exactly this code.

Round r of block b opens when r-1 closes, publishing version v; its first pull starts its
clock (deadline = start + deadline_s). It closes at the deadline; early once every expected
replica that can still pass has passed (its update accepted; a replica refused in the round can
no longer pass), or once a quorum passed and the grace period after it; never before the
minimum round length. It commits v + 1 if an update was accepted, else keeps v.

A replica is *expected* in round r if it is still assigned, pulled r or pushed for r-1, and was
heard from within the live window: a worker that dies holds its block up for one deadline at
most, and one that only pulls stops being expected once the live window passes.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from blocktrain.protocol.core.verdict import Verdict

NOT_A_REPORT = frozenset(
    {"duplicate", "future_round", "done", "unknown_worker", "not_assigned", "busy"}
)
"""Refusals that do not count as a replica reporting for its round (`unknown_worker`,
`not_assigned`: the worker is not a replica of the block; `busy`: the update was not judged,
and may come again)."""


class RoundPolicy(Protocol):
    """How rounds are run, the same for every block: the round fields of
    `settings.AggregatorSettings`, where each is declared, documented and bounded."""

    @property
    def deadline_s(self) -> float: ...
    @property
    def staleness(self) -> int: ...
    @property
    def stale_weight(self) -> float: ...
    @property
    def max_rounds(self) -> int | None: ...
    @property
    def live_window(self) -> float: ...
    @property
    def quorum(self) -> float: ...
    @property
    def grace_s(self) -> float | None: ...
    @property
    def min_round(self) -> float: ...


@dataclass(frozen=True)
class Contribution:
    """An accepted update waiting in the open round."""

    update_id: int
    worker_id: int
    tokens: int
    weight: float
    """Staleness factor (1 for an update of the round itself)."""
    round: int
    """The round the worker trained on (earlier than the open round when counted late)."""


@dataclass(frozen=True)
class RoundView:
    """What a pull sees: the round, the version it publishes, and its deadline."""

    block: int
    round: int
    version: int
    deadline: float | None
    done: bool


@dataclass(frozen=True)
class RoundClosed:
    """A round that closed: what to aggregate and what to record."""

    block: int
    round: int
    base_version: int
    new_version: int
    started_at: float | None
    deadline: float | None
    closed_at: float
    cause: str
    """"deadline", "all_reported" or "quorum"."""
    accepted: tuple[Contribution, ...]
    refused: int
    reported: frozenset[int]
    expected: frozenset[int]


@dataclass
class BlockRounds:
    """The round state of one block. Build it fresh (round 0, version 0) or from what a ledger
    recorded, then feed it pulls, judged updates and ticks."""

    block: int
    policy: RoundPolicy
    round: int = 0
    version: int = 0
    started_at: float | None = None
    assigned: set[int] = field(default_factory=set)
    pulled: set[int] = field(default_factory=set)
    reported: set[int] = field(default_factory=set)
    prev_reported: set[int] = field(default_factory=set)
    accepted: list[Contribution] = field(default_factory=list)
    refused: int = 0
    published: dict[int, int] = field(default_factory=dict)
    """Version published by each recent round (for updates counted late)."""
    stale_seen: set[tuple[int, int]] = field(default_factory=set)
    """(worker, round) of updates counted late, to refuse duplicates of them."""
    heard: dict[int, float] = field(default_factory=dict)
    """When each assigned worker last registered or reported (pulls do not count: a worker that
    only pulls is not doing the round's work)."""
    quorum_at: float | None = None
    """When the open round's quorum reported (None: not yet; `restore` finds it again)."""

    def __post_init__(self) -> None:
        self.published.setdefault(self.round, self.version)

    # ------------------------------------------------------------------ views

    @property
    def deadline(self) -> float | None:
        return None if self.started_at is None else self.started_at + self.policy.deadline_s

    @property
    def done(self) -> bool:
        return self.policy.max_rounds is not None and self.round >= self.policy.max_rounds

    def expected(self, now: float | None = None) -> frozenset[int]:
        """Replicas whose report the round waits for (see the module docstring); without `now`,
        before the live window is applied."""
        active = (self.pulled | self.prev_reported) & self.assigned
        if now is not None:
            window = self.policy.live_window
            active = {w for w in active if now - self.heard.get(w, now) <= window}
        return frozenset(active)

    @property
    def passed(self) -> frozenset[int]:
        """Replicas whose update of the open round was accepted (after every check, the effect
        probe included): only they count towards an early close. Refused pushes are reports
        (liveness, duplicates) but junk costs nothing to send, so it must not close a round
        (finding "quorum stuffing")."""
        return frozenset(c.worker_id for c in self.accepted if c.round == self.round)

    def waiting(
        self, now: float | None = None, expected: frozenset[int] | None = None
    ) -> frozenset[int]:
        """Expected replicas that can still pass the open round: those refused in it cannot (a
        second push is a duplicate), so the round stops waiting for them. Otherwise junk pushers
        on tokens of their own, expected and never passing, would hold every round to its
        deadline (finding "quorum stuffing", its second half)."""
        refused = self.reported - self.passed
        return (self.expected(now) if expected is None else expected) - refused

    def quorum_met(self, reported: Collection[int], expected: frozenset[int]) -> bool:
        """Whether `reported` (replicas that passed) holds the quorum of `expected` (at least
        one replica)."""
        need = max(1, math.ceil(self.policy.quorum * len(expected)))
        return bool(expected) and len(expected.intersection(reported)) >= need

    def _quorum(self, expected: frozenset[int], now: float) -> bool:
        """Whether the quorum has reported; notes when it first did."""
        if self.quorum_at is None:
            if not self.quorum_met(self.passed, expected):
                return False
            self.quorum_at = now
        return True

    def _grace_over(self, now: float) -> bool:
        assert self.quorum_at is not None
        grace = self.policy.grace_s
        if grace is None:  # as long again as the quorum took, at least a tenth of the deadline
            took = self.quorum_at - (self.started_at if self.started_at is not None else now)
            grace = max(took, self.policy.deadline_s / 10)
        return now >= self.quorum_at + grace

    def _min_over(self, now: float) -> bool:
        """Whether the round has been open (since its clock started) for the minimum round
        length, so that no early close comes in a burst."""
        started = self.started_at if self.started_at is not None else now
        return now >= started + self.policy.min_round

    def view(self) -> RoundView:
        return RoundView(self.block, self.round, self.version, self.deadline, self.done)

    # ------------------------------------------------------------------ events

    def assign(self, worker: int, now: float | None = None) -> None:
        """`worker` trains this block from now on (registered at `now`)."""
        self.assigned.add(worker)
        if now is not None:
            self.heard[worker] = max(self.heard.get(worker, now), now)

    def unassign(self, worker: int) -> None:
        """A worker left (or was moved): the round no longer waits for it."""
        self.assigned.discard(worker)
        self.heard.pop(worker, None)

    def pull(self, worker: int, now: float) -> RoundView:
        """`worker` fetched the weights of the open round; the first pull starts its clock."""
        if not self.done:
            if self.started_at is None:
                self.started_at = now
            self.pulled.add(worker)
        return self.view()

    def judge(self, worker: int, *, round: int, base_version: int, now: float) -> Verdict:
        """The timing verdict on an update of `worker` trained on `round` from `base_version`.
        Does not change any state: call `record` with the verdict once the update is stored."""
        if round > self.round:
            return Verdict.refuse(
                "future_round", f"round {round} has not opened; the open round is {self.round}"
            )
        if self.done:
            return Verdict.refuse(
                "done", f"block {self.block} finished its {self.policy.max_rounds} rounds"
            )
        if round == self.round:
            if worker in self.reported:
                return Verdict.refuse(
                    "duplicate", f"worker {worker} already reported for round {round}"
                )
            deadline = self.deadline
            if deadline is not None and now >= deadline:
                return Verdict.refuse(
                    "late",
                    f"round {round} reached its deadline {now - deadline:.3f}s before this update",
                )
            if base_version != self.version:
                return Verdict.refuse(
                    "stale_version",
                    f"round {round} published version {self.version}, not {base_version}",
                )
            return Verdict.ok(weight=1.0, counts_in=self.round)
        lateness = self.round - round
        if lateness > self.policy.staleness:
            return Verdict.refuse(
                "late",
                f"round {round} has closed; the open round is "
                f"{self.round} (staleness bound "
                f"{self.policy.staleness})",
            )
        if (worker, round) in self.stale_seen:
            return Verdict.refuse(
                "duplicate", f"worker {worker} already reported for round {round}"
            )
        published = self.published.get(round)
        if published != base_version:
            return Verdict.refuse(
                "stale_version", f"round {round} published version {published}, not {base_version}"
            )
        return Verdict.ok(weight=self.policy.stale_weight**lateness, counts_in=self.round)

    def record(
        self,
        worker: int,
        verdict: Verdict,
        *,
        round: int,
        now: float,
        update_id: int = -1,
        tokens: int = 0,
    ) -> None:
        """Record a judged update (accepted, or refused for any reason)."""
        if verdict.accepted:
            self.accepted.append(Contribution(update_id, worker, tokens, verdict.weight, round))
            if round != self.round:
                self.stale_seen.add((worker, round))
            if self.started_at is None:  # a late update into an idle round starts its clock
                self.started_at = now
        if verdict.reason in NOT_A_REPORT:
            return
        self.heard[worker] = max(self.heard.get(worker, now), now)
        if round == self.round:
            self.reported.add(worker)
            if not verdict.accepted:
                self.refused += 1
            self._quorum(self.waiting(now), now)
        elif round == self.round - 1:
            # it is alive: expect it in this round (a restart rebuilds this set from the
            # ledger's reports for the previous round, hence the same filter)
            self.prev_reported.add(worker)

    def tick(self, now: float) -> RoundClosed | None:
        """Close the open round if its deadline passed; or, once the minimum round length
        passed, if every replica it still waits for passed (its update accepted) or the
        quorum of them passed and the grace period after it passed."""
        if self.done:
            return None
        deadline = self.deadline
        expected = self.expected(now)
        waiting = self.waiting(now, expected)  # `expected` is read once a tick
        passed = self.passed
        quorum = self._quorum(waiting, now)  # notes when the quorum first passed
        if deadline is not None and now >= deadline:
            cause = "deadline"
        elif not self._min_over(now):
            return None
        elif passed and waiting <= passed:
            cause = "all_reported"
        elif quorum and self._grace_over(now):
            cause = "quorum"
        else:
            return None
        new_version = self.version + 1 if self.accepted else self.version
        closed = RoundClosed(
            block=self.block,
            round=self.round,
            base_version=self.version,
            new_version=new_version,
            started_at=self.started_at,
            deadline=deadline,
            closed_at=now,
            cause=cause,
            accepted=tuple(self.accepted),
            refused=self.refused,
            reported=frozenset(self.reported),
            expected=expected,
        )
        self.prev_reported = set(self.reported)
        self.round += 1
        self.version = new_version
        self.started_at = None
        self.quorum_at = None
        self.pulled = set()
        self.reported = set()
        self.accepted = []
        self.refused = 0
        self.published[self.round] = self.version
        keep = self.round - self.policy.staleness
        self.published = {r: v for r, v in self.published.items() if r >= keep}
        self.stale_seen = {(w, r) for w, r in self.stale_seen if r >= keep}
        return closed


def restore(
    block: int,
    policy: RoundPolicy,
    *,
    round: int,
    version: int,
    started_at: float | None,
    assigned: Iterable[int],
    pulled: Iterable[int],
    reported: Iterable[int],
    prev_reported: Iterable[int],
    accepted: Iterable[Contribution],
    refused: int,
    published: Mapping[int, int],
    heard: Mapping[int, float] | None = None,
    report_times: Mapping[int, float] | None = None,
) -> BlockRounds:
    """A block's round state rebuilt from a ledger after a restart. `heard`: when each assigned
    worker last registered or reported (one left out counts as just heard); `report_times`:
    when each reporter of the open round first reported, to find when the quorum of those
    that passed did."""
    state = BlockRounds(
        block,
        policy,
        round=round,
        version=version,
        started_at=started_at,
        assigned=set(assigned),
        pulled=set(pulled),
        reported=set(reported),
        prev_reported=set(prev_reported),
        accepted=list(accepted),
        refused=refused,
        published=dict(published),
        heard=dict(heard or {}),
    )
    state.stale_seen = {(c.worker_id, c.round) for c in state.accepted if c.round != round}
    passed = state.passed
    times = sorted((t, w) for w, t in (report_times or {}).items() if w in passed)
    for i, (t, _) in enumerate(times):  # the first report that made the quorum
        if state.quorum_met({w for _, w in times[: i + 1]}, state.waiting(t)):
            state.quorum_at = t
            break
    return state
