"""Relayed streams (`route = relay`, docs/protocol.md "Relayed streams"): what the replicas of
block b computed in their rounds, held for the workers of block b+1 to train on. `RelayPool`
decides which, the same for the aggregator and the simulator: the newest round's first, among
them the one handed out least (so that b+1's replicas train on different sequences), never one
the taker trained on already; it keeps the last `keep` rounds, at most `max_bytes` in all."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from blocktrain.protocol.core.verdict import Verdict
from blocktrain.relaystream import RelayStream, Shape, check

TIMING_REASONS = frozenset({"late", "stale_version", "future_round", "duplicate"})
"""Refusals of a delta that say nothing of its content: the stream pushed after it is kept."""


def keeps_stream(verdict: Verdict) -> bool:
    """Whether the stream sent after a delta with this verdict joins the pool: an accepted
    delta's, or one refused for its timing only (its features are as honest as its training);
    not one refused for its content (a stream of a suspect replica)."""
    return verdict.accepted or verdict.reason in TIMING_REASONS


KEEP_ROUNDS = 2
"""Rounds of streams a pool keeps: the newest, and the one before for a taker that is late."""


@dataclass
class Relayed:
    """One stream in the pool."""

    block: int
    """The block whose replica computed it."""
    round: int
    worker: int
    body: bytes
    steps: int
    taken_by: set[Hashable] = field(default_factory=set)
    """Workers (of the next block) it was handed to."""

    @property
    def key(self) -> tuple[int, int]:
        return self.round, self.worker

    def stream(self) -> RelayStream:
        return RelayStream.from_body(self.body)


class RelayPool:
    """The streams of one block's replicas (block `block`), for the next block's workers."""

    def __init__(
        self, block: int, shape: Shape, keep: int = KEEP_ROUNDS, max_bytes: int | None = None
    ) -> None:
        self.block = block
        self.shape = shape
        self.keep = keep
        self.max_bytes = max_bytes
        self._streams: dict[tuple[int, int], Relayed] = {}
        self._taken: dict[Hashable, set[tuple[int, int]]] = {}
        """taker -> the streams it was handed (until they leave the pool)."""

    def put(self, round: int, worker: int, body: bytes, *, max_body: int | None = None) -> Relayed:
        """Check a pushed stream (`relaystream.check` against the run's shape; a WireError says
        what is wrong) and keep it, replacing the same worker's stream of that round."""
        info = check(body, self.shape, max_bytes=max_body)
        relayed = Relayed(self.block, round, worker, bytes(body), info.steps)
        self._streams[relayed.key] = relayed
        self._prune()
        return relayed

    def newest_round(self) -> int | None:
        return max((r for r, _ in self._streams), default=None)

    def take(self, taker: Hashable, *, reuse: bool = False) -> Relayed | None:
        """The stream for worker `taker`: of the newest round holding one it has not trained on, the
        least handed out (then the lowest worker id); None when none, or with `reuse` the newest again."""
        seen = self._taken.setdefault(taker, set())
        fresh = [s for s in self._streams.values() if s.key not in seen]
        pool = fresh or (list(self._streams.values()) if reuse else [])
        if not pool:
            return None
        newest = max(s.round for s in pool)
        chosen = min(
            (s for s in pool if s.round == newest), key=lambda s: (len(s.taken_by), s.worker)
        )
        chosen.taken_by.add(taker)
        seen.add(chosen.key)
        return chosen

    @property
    def nbytes(self) -> int:
        return sum(len(s.body) for s in self._streams.values())

    def _prune(self) -> None:
        newest = self.newest_round()
        if newest is None:
            return
        for key in [k for k in self._streams if k[0] <= newest - self.keep]:
            del self._streams[key]
        while (
            self.max_bytes is not None and self.nbytes > self.max_bytes and len(self._streams) > 1
        ):
            del self._streams[min(self._streams)]
        for seen in self._taken.values():
            seen.intersection_update(self._streams)
