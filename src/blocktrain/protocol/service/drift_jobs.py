"""Each commit's drift observation (`drift.DriftTracker.observe`: two selections over every
coordinate of every vote, 3 s for 100 votes of 1M on one core) on a thread of its own, outside
the service's lock, so that pulls, long polls, status and the other blocks' pushes go on
meanwhile. A block's pushes wait for its last observation before they are judged, so that a
flag refuses the same updates, and a halved reputation weighs the same votes, as when the
commit observed them itself."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from blocktrain.protocol.core.drift import Drifted
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.rounds import RoundClosed
from blocktrain.protocol.store.persist import warn_drifted

log = logging.getLogger(__name__)


class DriftJobs:
    """One thread observes the commits in their order (the tracker's sketches are its alone);
    the flags it raises are applied under the service's `lock`."""

    def __init__(self, engine: RoundEngine, lock: threading.RLock) -> None:
        self.engine = engine
        self.lock = lock
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="drift")
        self.last: dict[int, Future[None]] = {}
        """block -> its last observation."""
        engine.drift_later = self.submit

    def submit(self, closed: RoundClosed, observe: Callable[[], list[Drifted]]) -> None:
        """Called inside the commit, under the lock: only queues."""
        self.last[closed.block] = self.pool.submit(self._run, closed, observe)

    def _run(self, closed: RoundClosed, observe: Callable[[], list[Drifted]]) -> None:
        try:
            drifted = observe()
        except Exception:  # a push must not fail for it: the round stays committed, unobserved
            log.exception(
                "block %d round %d: the drift observation failed", closed.block, closed.round
            )
            return
        with self.lock:
            self.engine.penalise(drifted, closed.closed_at)
        warn_drifted(closed, drifted)

    def wait(self, block: int) -> None:
        """Until the block's last observation is applied (call it outside the lock)."""
        last = self.last.get(block)
        if last is not None:
            last.result()
