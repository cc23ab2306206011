"""The autoregressive pipeline's KV caches on a host, per generation (session)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from blocktrain.model.pipeline import KVCache
from blocktrain.serving.errors import SessionLost


@dataclass
class _Session:
    caches: dict[int, KVCache] = field(default_factory=dict)
    touched: float = 0.0


class SessionStore:
    """The KV caches of the generations in flight, per (model, session id), least recently used
    first. Not thread-safe by itself: the host uses it under its compute lock."""

    def __init__(self, max_sessions: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self._items: OrderedDict[tuple[str, str], _Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def open(self, model: str, session: str, stage: int, pos: int) -> KVCache:
        """The cache of `stage` for a step at position `pos`: a fresh one at pos 0, else the one
        left by the previous step, which must hold at least `pos` positions. A cache that holds
        more is cut back to `pos`: the positions past it held drafted bytes that the router's
        verification rejected (speculative decoding)."""
        now = self.clock()
        for key in [k for k, s in self._items.items() if now - s.touched > self.ttl_s]:
            del self._items[key]
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
        entry.touched = now
        self._items.move_to_end(key)
        while len(self._items) > self.max_sessions:
            self._items.popitem(last=False)
        return entry.caches[stage]

    def close(self, model: str, session: str, stages: list[int]) -> None:
        """Drop the caches of `stages` (the session once none is left)."""
        entry = self._items.get((model, session))
        if entry is None:
            return
        for stage in stages:
            entry.caches.pop(stage, None)
        if not entry.caches:
            del self._items[(model, session)]
