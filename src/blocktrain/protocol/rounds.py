"""Rounds and deadlines (DESIGN.md section 4): the pure state machine of one block, and the
registry that assigns workers to blocks.

Nothing here reads a clock, sleeps, does I/O or touches tensors: every method that depends on
time takes `now` (seconds on whatever clock the caller keeps), so the aggregator, the
single-machine simulator and the tests drive exactly this code, the last two with virtual time.

Life of round r of block b:

    opened    when round r-1 closes (round 0 at the start), publishing version v
    started   at the first pull of round r: its deadline is started + deadline_s
    judged    each update: accepted, or refused with a reason (late, stale_version, ...)
    closed    at the deadline, or early once every expected replica has reported
    committed version v + 1 if at least one update was accepted, else v (weights kept)

A replica is *expected* in round r if it is still assigned to the block and either pulled round
r or pushed something for round r-1. A worker that dies therefore holds its block up for at
most one deadline: it is expected in the round it died in, which closes at the deadline, and
not in the next one (it neither pulled it nor pushed for the one before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from blocktrain.protocol.verdict import Verdict

NOT_A_REPORT = frozenset({"duplicate", "future_round", "done"})
"""Refusals that do not count as a replica reporting for its round."""


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
    """"deadline" or "all_reported"."""
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

    def __post_init__(self) -> None:
        self.published.setdefault(self.round, self.version)

    # ------------------------------------------------------------------ views

    @property
    def deadline(self) -> float | None:
        return None if self.started_at is None else self.started_at + self.policy.deadline_s

    @property
    def done(self) -> bool:
        return self.policy.max_rounds is not None and self.round >= self.policy.max_rounds

    def expected(self) -> frozenset[int]:
        """Replicas whose report the round waits for (see the module docstring)."""
        return frozenset((self.pulled | self.prev_reported) & self.assigned)

    def view(self) -> RoundView:
        return RoundView(self.block, self.round, self.version, self.deadline, self.done)

    # ------------------------------------------------------------------ events

    def assign(self, worker: int) -> None:
        self.assigned.add(worker)

    def unassign(self, worker: int) -> None:
        """A worker left (or was moved): the round no longer waits for it."""
        self.assigned.discard(worker)

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
        if round == self.round:
            self.reported.add(worker)
            if not verdict.accepted:
                self.refused += 1
        elif round == self.round - 1:
            # it is alive: expect it in this round (a restart rebuilds this set from the
            # ledger's reports for the previous round, hence the same filter)
            self.prev_reported.add(worker)

    def tick(self, now: float) -> RoundClosed | None:
        """Close the open round if its deadline passed or every expected replica reported."""
        if self.done:
            return None
        deadline = self.deadline
        expected = self.expected()
        if deadline is not None and now >= deadline:
            cause = "deadline"
        elif self.reported and expected <= self.reported:
            cause = "all_reported"
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
        self.pulled = set()
        self.reported = set()
        self.accepted = []
        self.refused = 0
        self.published[self.round] = self.version
        keep = self.round - self.policy.staleness
        self.published = {r: v for r, v in self.published.items() if r >= keep}
        self.stale_seen = {(w, r) for w, r in self.stale_seen if r >= keep}
        return closed


# ---------------------------------------------------------------------------------------------
# Workers and their blocks
# ---------------------------------------------------------------------------------------------


@dataclass
class WorkerEntry:
    block: int
    last_seen: float
    token: int | None = None
    """The identity the worker speaks for (its bearer token's id); None: itself."""


@dataclass
class Registry:
    """Which worker trains which block, and when each was last heard from."""

    blocks: int
    live_window_s: float
    workers: dict[int, WorkerEntry] = field(default_factory=dict)

    def add(self, worker: int, block: int, now: float, token: int | None = None) -> None:
        self.workers[worker] = WorkerEntry(block, now, token)

    def identity(self, worker: int) -> tuple[str, int]:
        """Who a worker votes as: its token when it has one, else itself. Aggregation and
        quotas count identities, never workers, so one token's many workers are one voice."""
        entry = self.workers.get(worker)
        if entry is None or entry.token is None:
            return ("worker", worker)
        return ("token", entry.token)

    def remove(self, worker: int) -> None:
        self.workers.pop(worker, None)

    def seen(self, worker: int, now: float) -> None:
        entry = self.workers.get(worker)
        if entry is not None:
            entry.last_seen = max(entry.last_seen, now)

    def block_of(self, worker: int) -> int | None:
        entry = self.workers.get(worker)
        return None if entry is None else entry.block

    def live(self, now: float) -> dict[int, int]:
        """Worker -> block, for workers heard from within the live window."""
        return {
            w: e.block for w, e in self.workers.items() if now - e.last_seen <= self.live_window_s
        }

    def live_per_block(self, now: float) -> list[int]:
        counts = [0] * self.blocks
        for block in self.live(now).values():
            counts[block] += 1
        return counts

    def choose_block(
        self, now: float, requested: int | None = None, exclude: Iterable[int] = ()
    ) -> int:
        """The requested block, else the one with the fewest live replicas (lowest index on
        ties), skipping `exclude` (e.g. finished blocks) when another is left."""
        if requested is not None:
            if not 0 <= requested < self.blocks:
                raise ValueError(f"block {requested} is outside 0..{self.blocks - 1}")
            return requested
        counts = self.live_per_block(now)
        skip = set(exclude)
        candidates = [b for b in range(self.blocks) if b not in skip] or list(range(self.blocks))
        return min(candidates, key=lambda b: (counts[b], b))


def in_time(closed: RoundClosed) -> int:
    """Accepted updates of the round itself (not those counted in it late, from an earlier
    round)."""
    return sum(1 for c in closed.accepted if c.round == closed.round)


def participation(in_time: int, expected: int) -> float:
    """The participation of one round, or of several summed (docs/protocol.md, Accounting):
    updates of the round itself accepted, over the replicas it expected. Updates counted late
    (staleness > 0) are not in the numerator: they are the previous round's participation,
    come too late. A round that expected nobody has participation 1 if it accepted an update
    of its own, else 0."""
    return in_time / expected if expected else float(in_time > 0)


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
) -> BlockRounds:
    """A block's round state rebuilt from a ledger after a restart."""
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
    )
    state.stale_seen = {(c.worker_id, c.round) for c in state.accepted if c.round != round}
    return state
