"""Each commit's drift observation (`drift.DriftTracker.observe`: two selections over every
coordinate of every vote; bench/commit_cost.py: 1.0 s of a 100-vote commit of 1M on one core,
5.7 s of a 333-vote one, the aggregation the rest: 0.06 and 0.19 s) on a thread of its own,
outside the service's lock, so that pulls, long polls, status and every push go on meanwhile.
Pushes are judged on the flags known so far; the block's open round does not close until the
observation's flags are in (`RoundEngine.observing`), and a flagged identity's updates accepted
in it meanwhile are dropped, refused `drift` in the ledger (as a revoked token's are). So a flag
keeps the same votes out of the same versions, and a halved reputation weighs the same votes, as
when the commit observed them itself; only the answer of such an update said accepted. Pushes
used to wait for the observation instead: at 1,000 workers on 3 blocks that wait held the
request threads (docs/protocol.md, Drift)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from blocktrain.protocol.core.drift import Drifted
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.rounds import RoundClosed
from blocktrain.protocol.store.ledger_schema import fsync_wal
from blocktrain.protocol.store.persist import Durable, warn_drifted

log = logging.getLogger(__name__)

Job = tuple[RoundClosed, Callable[[], list[Drifted]], threading.Event]


class DriftJobs:
    """One thread observes the commits in their order (the tracker's sketches are its alone);
    the flags it raises are applied under the service's `lock`. A daemon: a stopping
    aggregator does not wait for observations (the sketches live in memory only)."""

    def __init__(
        self,
        engine: RoundEngine,
        lock: threading.RLock,
        durable: Durable,
        clock: Callable[[], float],
    ) -> None:
        self.engine = engine
        self.lock = lock
        self.durable = durable
        self.clock = clock
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
            except Exception:  # the thread outlives any one commit: every block waits on it
                log.exception(
                    "block %d round %d: applying the drift observation failed",
                    closed.block,
                    closed.round,
                )
            finally:
                done.set()

    def _run(self, closed: RoundClosed, observe: Callable[[], list[Drifted]]) -> None:
        drifted: list[Drifted] = []
        try:
            drifted = observe()
        except Exception:  # the round stays committed, unobserved, and the next one may close
            log.exception(
                "block %d round %d: the drift observation failed", closed.block, closed.round
            )
        with self.lock:
            try:
                self.engine.penalise(drifted, closed.closed_at)
                self._drop(closed.block, drifted)
            finally:
                self.engine.observing.discard(closed.block)
                self.engine.tick(self.clock())  # the open round, if it became due meanwhile
        fsync_wal(self.durable.ledger.path)  # the drops' rows, and a commit's the tick made
        warn_drifted(closed, drifted)

    def _drop(self, block: int, drifted: list[Drifted]) -> None:
        """The flagged identities' updates accepted in the block's open round leave it."""
        entries = self.engine.blocks[block].acc.entries
        for d in drifted:  # one flag an identity
            ids = [uid for uid, e in entries.items() if e.identity == d.identity]
            detail = (
                f"dropped from its round: this identity's last {d.votes} accepted votes on block "
                f"{block} leaned one way against the others' (drift score {d.score:.2f}); its "
                f"updates are refused until round {d.until} closes"
            )
            self.durable.drop_updates(self.engine, block, ids, "drift", detail)

    def wait(self, block: int) -> None:
        """Until the block's last observation is applied (outside the lock; tests)."""
        done = self.last.get(block)
        if done is not None:
            done.wait()
