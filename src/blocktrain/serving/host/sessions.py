"""The caches a host keeps per generation (session): the autoregressive KV caches per stage and
the blocks' clean-stream caches, in one least-recently-used store bounded by a count, a time to
live and bytes. A dropped BlockTrain cache only costs the next sweep a recomputation, an
autoregressive one a prefill (`SessionLost`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from blocktrain.model.cached import CleanCache
from blocktrain.model.pipeline import KVCache
from blocktrain.serving.shared.serving_errors import SessionLost


@dataclass
class _Session:
    caches: dict[int, KVCache] = field(default_factory=dict)
    touched: float = 0.0
    nbytes: int = 0
    """Its caches' bytes when last counted (an autoregressive cache grows after `open`; it is
    counted again at the session's next use)."""


class SessionStore:
    """The caches of the generations in flight, per (model, session id), least recently used
    first. Thread-safe for its own bookkeeping; the caches it hands out are used under the
    host's compute lock."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        clock: Callable[[], float],
        max_bytes: int | None = None,
    ) -> None:
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """The bytes of every cache, as last counted."""
        return self._bytes

    def open(self, model: str, session: str, stage: int, pos: int) -> KVCache:
        """The cache of `stage` for a step at position `pos`: a fresh one at pos 0, else the
        previous step's, which must hold at least `pos` positions; one that holds more is cut
        back to `pos` (rejected drafted bytes)."""
        with self._lock:
            self._expire()
            key = (model, session)
            entry = self._items.get(key)
            if pos == 0:
                if entry is None:
                    entry = self._items[key] = _Session()
                entry.caches[stage] = KVCache()
            elif entry is None or stage not in entry.caches:
                raise SessionLost(
                    f"no KV cache for session {session} (stage {stage}): the host "
                    "restarted or dropped it; prefill again from position 0"
                )
            elif entry.caches[stage].length < pos:
                raise SessionLost(
                    f"session {session} stage {stage} holds "
                    f"{entry.caches[stage].length} positions, the step says {pos}"
                )
            else:
                entry.caches[stage].truncate(pos)
            self._touch(key, entry)
            return entry.caches[stage]

    def clean(self, model: str, session: str, blocks: list[int]) -> dict[int, CleanCache]:
        """The clean-stream caches the session holds for `blocks` (any it lacks are missing
        from the answer: that block recomputes its context)."""
        with self._lock:
            self._expire()
            entry = self._items.get((model, session))
            if entry is None:
                return {}
            out = {}
            for b in blocks:
                cache = entry.caches.get(b)
                if isinstance(cache, CleanCache):
                    out[b] = cache
            return out

    def keep(self, model: str, session: str, caches: dict[int, CleanCache]) -> None:
        """Store the session's clean-stream caches of these blocks (replacing its old ones)."""
        with self._lock:
            key = (model, session)
            entry = self._items.get(key)
            if entry is None:
                entry = self._items[key] = _Session()
            entry.caches.update(caches)
            self._touch(key, entry)

    def close(self, model: str, session: str, parts: list[int]) -> None:
        """Drop the caches of `parts` (stages or blocks; the session once none is left)."""
        with self._lock:
            key = (model, session)
            entry = self._items.get(key)
            if entry is None:
                return
            for part in parts:
                entry.caches.pop(part, None)
            if not entry.caches:
                self._drop(key)
            else:
                self._count(entry)

    def release(self, model: str, session: str) -> bool:
        """Drop every cache of a generation that ended without a closing message (a stop
        sequence, a speculative one, a client that left); whether it held any here."""
        with self._lock:
            key = (model, session)
            if key not in self._items:
                return False
            self._drop(key)
            return True

    # Under the lock:

    def _expire(self) -> None:
        # The least recently used first: the expired ones lead, the first live one ends it.
        now = self.clock()
        while self._items:
            key, first = next(iter(self._items.items()))
            if now - first.touched <= self.ttl_s:
                break
            self._drop(key)

    def _count(self, entry: _Session) -> None:
        before, entry.nbytes = entry.nbytes, sum(c.nbytes() for c in entry.caches.values())
        self._bytes += entry.nbytes - before

    def _touch(self, key: tuple[str, str], entry: _Session) -> None:
        entry.touched = self.clock()
        self._count(entry)
        self._items.move_to_end(key)
        while len(self._items) > self.max_sessions or (
            self.max_bytes is not None and self._bytes > self.max_bytes and self._items
        ):
            self._drop(next(iter(self._items)))

    def _drop(self, key: tuple[str, str]) -> None:
        self._bytes -= self._items.pop(key).nbytes
