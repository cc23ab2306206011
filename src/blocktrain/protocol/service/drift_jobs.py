"""Each commit's drift observation (`drift.DriftTracker.observe`: two selections over every
coordinate of every vote; bench/commit_cost.py: a commit of 100 votes of 1M is 1.3 s on one
core) on a thread of its own, outside
the service's lock, so that pulls, long polls, status and the other blocks' pushes go on
meanwhile. A block's pushes wait for its last observation before they are judged, so that a
flag refuses the same updates, and a halved reputation weighs the same votes, as when the
commit observed them itself."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from blocktrain.protocol.core.drift import Drifted
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.rounds import RoundClosed
from blocktrain.protocol.store.persist import warn_drifted

log = logging.getLogger(__name__)

Job = tuple[RoundClosed, Callable[[], list[Drifted]], threading.Event]


class DriftJobs:
    """One thread observes the commits in their order (the tracker's sketches are its alone);
    the flags it raises are applied under the service's `lock`. A daemon: a stopping
    aggregator does not wait for observations (the sketches live in memory only)."""

    def __init__(self, engine: RoundEngine, lock: threading.RLock) -> None:
        self.engine = engine
        self.lock = lock
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.last: dict[int, threading.Event] = {}
        """block -> set once its last observation is applied."""
        threading.Thread(target=self._serve, name="drift", daemon=True).start()
        engine.drift_later = self.submit

    def submit(self, closed: RoundClosed, observe: Callable[[], list[Drifted]]) -> None:
        """Called inside the commit, under the lock: only queues."""
        done = self.last[closed.block] = threading.Event()
        self.jobs.put((closed, observe, done))

    def _serve(self) -> None:
        while True:
            closed, observe, done = self.jobs.get()
            try:
                self._run(closed, observe)
            finally:
                done.set()

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
        done = self.last.get(block)
        if done is not None:
            done.wait()
