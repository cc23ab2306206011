"""The registry: which worker trains which block, for which token, and when each was last heard
from. Pure like `rounds`: no clock, no I/O; every time is passed in."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field


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

    def workers_of(self, token: int) -> list[int]:
        """The registered workers of a token, oldest first."""
        return sorted(w for w, e in self.workers.items() if e.token == token)

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
        """Live identities per block: one token's many workers on a block count once, so
        flooding a block cannot make it look served and steer honest workers away."""
        voices: list[set[tuple[str, int]]] = [set() for _ in range(self.blocks)]
        for worker, block in self.live(now).items():
            voices[block].add(self.identity(worker))
        return [len(v) for v in voices]

    def choose_block(
        self,
        now: float,
        requested: int | None = None,
        exclude: Iterable[int] = (),
        allowed: Collection[int] | None = None,
    ) -> int:
        """The requested block, else the one with the fewest live identities (lowest index on
        ties) among `allowed` (a pinned token's blocks; None: all), skipping `exclude` (e.g.
        finished blocks) when another is left."""
        if requested is not None:
            if not 0 <= requested < self.blocks:
                raise ValueError(f"block {requested} is outside 0..{self.blocks - 1}")
            return requested
        counts = self.live_per_block(now)
        pool = [b for b in range(self.blocks) if allowed is None or b in allowed]
        if not pool:
            raise ValueError(f"none of the blocks {sorted(allowed or ())} exists")
        skip = set(exclude)
        candidates = [b for b in pool if b not in skip] or pool
        return min(candidates, key=lambda b: (counts[b], b))
