"""The aggregator's live evaluation (`live_eval_every` = N > 0): the validation CE of the
assembled model while the run trains, for `/v1/history`, the dashboard and `blocktrain report`.

The model after R rounds is every block's version after its R-th round: each commit of a due
round lends its weights until every block has committed it; then the model waits for the one
background thread that evaluates, off the request path. A newer model replaces one still waiting
(the curve skips a point rather than fall behind), and at most `MAX_INCOMPLETE` rounds wait for
a slow block. Each evaluation is a record in STATE/evals.jsonl; a restart reads them back and
evaluates the newest complete model not yet recorded. The evaluator is injected (`ModelEval`),
so the protocol never imports the model."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from blocktrain.errors import ProtocolError
from blocktrain.protocol.core.events import Committed, EngineBlock
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.store.storage import StateDir

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

MAX_INCOMPLETE = 4
"""Due rounds whose model waits for a slow block's commit, at most (each holds the weights of
the blocks that committed it)."""


class ModelEval(Protocol):
    @property
    def bytes(self) -> int:
        """The validation bytes scored."""
        ...

    @property
    def sweeps(self) -> int:
        """M, the sweeps from noise."""
        ...

    def __call__(self, blocks: Mapping[int, Tensors]) -> dict[str, float]:
        """The validation CEs (history.EVAL_KEYS) of the model assembled from `blocks`."""
        ...


class LiveEvaluations:
    """Which models are due, the one waiting, the thread that evaluates and the records."""

    def __init__(
        self,
        storage: StateDir,
        settings: AggregatorSettings,
        evaluator: ModelEval,
        blocks: Mapping[int, EngineBlock],
        clock: Callable[[], float],
    ) -> None:
        if settings.live_eval_every <= 0:
            raise ProtocolError("the live evaluation needs live_eval_every > 0")
        self.n_blocks = storage.n_blocks()
        if sorted(blocks) != list(range(self.n_blocks)):
            raise ProtocolError(
                f"live_eval_every = {settings.live_eval_every} evaluates the assembled model, "
                f"and this aggregator holds blocks {sorted(blocks)} of {self.n_blocks}: serve "
                "every block here, or live_eval_every = 0"
            )
        self.storage = storage
        self.every = settings.live_eval_every
        self.max_rounds = settings.max_rounds
        self.evaluator = evaluator
        self.clock = clock
        self.records: list[dict[str, Any]] = storage.evals()
        self.done = {int(r["rounds"]) for r in self.records}
        self.skipped = 0
        """Complete models replaced while they waited (the evaluator was busy)."""
        self._incomplete: dict[int, dict[int, tuple[int, Tensors]]] = {}
        """rounds -> block -> (version, weights) of the blocks that committed them."""
        self._waiting: tuple[int, dict[int, tuple[int, Tensors]], float | None] | None = None
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        with self._cond:  # before the thread starts: nothing waits on it yet
            self._resume({b: st.rounds.round for b, st in blocks.items()})
        self._thread = threading.Thread(target=self._run, name="live-eval", daemon=True)
        self._thread.start()

    def due(self, rounds: int) -> bool:
        """Whether the model after `rounds` rounds is to be evaluated (and is not yet)."""
        if rounds in self.done:
            return False
        if self.max_rounds is not None and rounds > self.max_rounds:
            return False
        return rounds % self.every == 0 or rounds == self.max_rounds

    # ------------------------------------------------------------------ commits

    def on_commit(self, event: Committed) -> None:
        """An `engine.on_commit` listener (under the service's lock: it only lends weights)."""
        closed = event.closed
        rounds = closed.round + 1
        with self._cond:
            if not self.due(rounds):
                return
            have = self._incomplete.setdefault(rounds, {})
            have[closed.block] = (closed.new_version, event.weights)
            if len(have) == self.n_blocks:
                self._submit(rounds, self._incomplete.pop(rounds), closed.closed_at)
            self._bound()

    def _bound(self) -> None:
        while len(self._incomplete) > MAX_INCOMPLETE:
            oldest = min(self._incomplete)
            missing = sorted(set(range(self.n_blocks)) - set(self._incomplete.pop(oldest)))
            log.warning(
                "live evaluation: the model after %d rounds is dropped: block(s) %s have not "
                "closed round %d while the others moved %d due rounds on",
                oldest,
                missing,
                oldest - 1,
                MAX_INCOMPLETE,
            )

    def _submit(
        self, rounds: int, blocks: dict[int, tuple[int, Tensors]], at: float | None
    ) -> None:
        if self._waiting is not None:
            self.skipped += 1
            log.info(
                "live evaluation: the model after %d rounds is skipped (the evaluator is busy; "
                "the one after %d rounds takes its place)",
                self._waiting[0],
                rounds,
            )
        self._waiting = (rounds, blocks, at)
        self._cond.notify_all()

    # ------------------------------------------------------------------ restart

    def _resume(self, closed: dict[int, int]) -> None:
        """After a (re)start: the newest complete model not yet recorded, from disk, and the
        blocks' weights of the due rounds that others have not closed yet."""
        rows = self.storage.ledger.rounds()
        after = {(r["block"], r["round"] + 1): r for r in rows}

        def version(b: int, rounds: int) -> int:
            return 0 if rounds == 0 else int(after[(b, rounds)]["new_version"])

        slowest, fastest = min(closed.values()), max(closed.values())
        complete = [r for r in range(slowest + 1) if self.due(r)]
        if complete:
            rounds = complete[-1]
            loaded = self._load({b: version(b, rounds) for b in closed}, rounds)
            if loaded is not None:
                at = None if rounds == 0 else max(after[(b, rounds)]["closed_at"] for b in closed)
                self._submit(rounds, loaded, at)
        waiting = [r for r in range(slowest + 1, fastest + 1) if self.due(r)]
        for rounds in waiting[-MAX_INCOMPLETE:]:  # the older ones would be dropped at once
            ahead = {b: version(b, rounds) for b, n in closed.items() if n >= rounds}
            loaded = self._load(ahead, rounds)
            if loaded is not None:
                self._incomplete[rounds] = loaded
        self._bound()

    def _load(self, versions: dict[int, int], rounds: int) -> dict[int, tuple[int, Tensors]] | None:
        missing = [(b, v) for b, v in versions.items() if not self.storage.has_tensors(b, v)]
        if missing:
            log.warning(
                "live evaluation: the model after %d rounds is not evaluated: version(s) %s "
                "are no longer on disk (keep_versions)",
                rounds,
                ", ".join(f"{v} of block {b}" for b, v in missing),
            )
            return None
        return {b: (v, self.storage.load_tensors(b, v)) for b, v in versions.items()}

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                assert self._waiting is not None
                job, self._waiting = self._waiting, None
                self._busy = True
            try:
                self._evaluate(*job)
            except Exception:  # the aggregator serves on; the next model is evaluated
                log.exception("live evaluation of the model after %d rounds failed", job[0])
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _evaluate(
        self, rounds: int, blocks: dict[int, tuple[int, Tensors]], at: float | None
    ) -> None:
        started = time.perf_counter()
        values = self.evaluator({b: w for b, (_, w) in blocks.items()})
        record: dict[str, Any] = {
            "rounds": rounds,
            **values,
            "split": "valid",
            "bytes": self.evaluator.bytes,
            "sweeps": self.evaluator.sweeps,
            "versions": {str(b): v for b, (v, _) in sorted(blocks.items())},
            "at": at,
            "evaluated_at": self.clock(),
            "eval_s": round(time.perf_counter() - started, 3),
        }
        with self._cond:
            records = sorted([*self.records, record], key=lambda r: int(r["rounds"]))
        self.storage.write_evals(records)  # only this thread writes the file
        with self._cond:
            self.records = records
            self.done.add(rounds)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items())
        log.info(
            "live evaluation after %d rounds: %s (%d bytes, M = %d, %.2f s)",
            rounds,
            shown,
            record["bytes"],
            record["sweeps"],
            record["eval_s"],
        )

    # ------------------------------------------------------------------ waiting, stopping

    @property
    def recorded(self) -> int:
        """How many evaluations are recorded (the history's cache key)."""
        return len(self.records)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until no model waits and none is being evaluated; whether that happened."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (an evaluation under way may finish within `timeout_s`; the one
        waiting is dropped: a restart evaluates the newest complete model again)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
