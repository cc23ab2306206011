"""The aggregator's service: the round engine on the wall clock, with every event persisted,
and the functions the HTTP routes call. The engine takes every decision; this adds identity
(the `admission` mixin), the ledger, durable bodies, committed versions on disk, byte counters
and a lock. Time comes from the injected `clock` (epoch seconds: deadlines survive a restart)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from blocktrain.errors import ProtocolError
from blocktrain.httpserve import FailedAuth, TokenBucket
from blocktrain.protocol.core.bodies import encode
from blocktrain.protocol.core.events import Committed, EngineBlock
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import refused
from blocktrain.protocol.service import identity
from blocktrain.protocol.service.access import AccessLimits
from blocktrain.protocol.service.drift_jobs import DriftJobs
from blocktrain.protocol.service.identity import Caller
from blocktrain.protocol.service.live_eval import LiveEvaluations, ModelEval
from blocktrain.protocol.service.placement import Directory, placed
from blocktrain.protocol.service.pushes import Pushes
from blocktrain.protocol.service.streams import Streams
from blocktrain.protocol.service.updates import PullReply
from blocktrain.protocol.store.ledger_schema import TokenRow
from blocktrain.protocol.store.persist import Durable
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.traffic import Traffic

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
Clock = Callable[[], float]


class AggregatorService(Pushes, Streams):
    """The aggregator without HTTP. Thread-safe: one lock guards the engine."""

    def __init__(
        self,
        settings: AggregatorSettings | None = None,
        *,
        storage: StateDir,
        clock: Clock = time.time,
        limits: AccessLimits | None = None,
        rate_clock: Clock = time.monotonic,
        directory: Directory | None = None,
        evaluator: ModelEval | None = None,
    ) -> None:
        self.storage = storage
        self.limits = limits or AccessLimits()
        self.limiter = TokenBucket(self.limits.rate_per_s, self.limits.burst, rate_clock)
        self.failed_auth = FailedAuth(self.limits.http, rate_clock)
        self._pruned_at: float | None = None
        manifest = storage.manifest()
        self.settings = settings if settings is not None else storage.settings()
        self.run_config: dict[str, Any] = dict(manifest["run_config"])
        self.run_id = storage.run_id()
        self.n_blocks = int(manifest["blocks"])
        self.directory = (
            placed(storage)
            if directory is None
            else placed(storage, directory.served, directory.peers)
        )
        """The blocks served here (as the state folder saved them, `placement.placed`); the
        others are refused with where they live, and leave no trace here."""
        self.clock = clock
        self.ledger = storage.ledger
        self.traffic = Traffic(self.ledger, self.directory.served)
        self.lock = threading.RLock()
        self.probe_lock = threading.Lock()
        """The effect probe runs one update at a time (PROBE_SLOTS bound those waiting)."""
        self.started_at = clock()
        self.durable = Durable(storage, self.settings)
        self._cache: dict[int, tuple[tuple[int, int, float | None], bytes]] = {}
        """block -> ((version, round, deadline), the encoded body of the last pull)."""
        self.engine = self.durable.restore(self.directory.served)
        self.engine.on_commit.append(self.durable.commit)
        self.drift_jobs = DriftJobs(self.engine, self.lock, self.durable, clock)
        self.blocks: dict[int, EngineBlock] = self.engine.blocks
        self.max_body = self.engine.max_body
        self._shut_out: set[int] = set()  # revoked or banned tokens already dropped
        self._init_streams(sorted(self.directory.served), self.settings.local_steps)
        self.evaluations: LiveEvaluations | None = None
        """The live evaluation (`live_eval_every`, `live_eval.py`), given an `evaluator`."""
        if self.settings.live_eval_every > 0:
            if evaluator is None:
                log.warning(
                    "live_eval_every = %d, but this aggregator was given no evaluator: no live "
                    "evaluation",
                    self.settings.live_eval_every,
                )
            else:
                self.evaluations = LiveEvaluations(
                    storage, self.settings, evaluator, self.blocks, clock
                )
                self.engine.on_commit.append(self.evaluations.on_commit)
        self.tick()

    # ------------------------------------------------------------------ workers

    def register(
        self,
        *,
        token: TokenRow,
        block: int | None = None,
        name: str | None = None,
        resume: int | None = None,
    ) -> dict[str, Any]:
        """A new worker of `token`, or with `resume` its own worker taken back, on its block
        and under its id (so its data seed), whether it left or timed out (`resumable`)."""
        if resume is not None:
            block = self.resumable(token, resume, block)
        if block is not None:
            self.check_block(block)
        allowed = identity.allowed_blocks(token, self.n_blocks, block)
        if len(self.directory.served) < self.n_blocks:
            allowed = self.directory.allowed(allowed)
        with self.lock:
            now = self.clock()

            def add(chosen: int) -> int:
                if resume is not None:
                    return self.ledger.revive_worker(resume, name, now)
                return self.ledger.add_worker(token.id, chosen, name, now)

            reg = self.engine.register(now, block, add, token.id, allowed, resume)
            for old in reg.replaced:  # the token's oldest workers, retired for this one
                self.ledger.worker_left(old, now)
        verb = "resumed" if resume is not None else "registered"
        log.info("worker %d (%s) %s on block %d", reg.worker, token.name, verb, reg.block)
        seed = int(self.run_config.get("seed", 0))
        return {
            "resumed": resume is not None,
            "run_id": self.run_id,
            "worker_id": reg.worker,
            "block": reg.block,
            "data_seed": seed * self.settings.n_workers + reg.worker,
            "local_steps": self.settings.local_steps,
            "round": reg.view.round,
            "version": reg.view.version,
            "wire_dtype": self.settings.wire_dtype,
            "delta_wire": self.settings.push_wire,
            "pull_wire": self.settings.pulls,
            "exact_pulls": self.settings.commit_codec is not None,
            "done": reg.view.done,
        }

    def leave(self, *, caller: Caller) -> dict[str, Any]:
        assert caller.worker_id is not None
        with self.lock:
            now = self.clock()
            self.ledger.worker_left(caller.worker_id, now)
            self.engine.leave(caller.worker_id, now)
        log.info("worker %d left", caller.worker_id)
        return {"worker_id": caller.worker_id, "left": True}

    def public_settings(self) -> dict[str, Any]:
        return {**self.settings.to_dict(), "max_body_bytes": self.max_body}

    def config(self) -> dict[str, Any]:
        return {
            "run_config": self.run_config,
            "run_id": self.run_id,
            "protocol": self.public_settings(),
            "blocks": self.n_blocks,
            "tensors": {
                str(b): {k: list(v) for k, v in st.spec.shapes.items()}
                for b, st in self.blocks.items()
            },
        }

    # ------------------------------------------------------------------ pulls

    def pull(self, *, caller: Caller, block: int, with_body: bool = True) -> PullReply:
        """The open round's weights in the wire dtype (an empty body unless `with_body`: the
        caller fetches the version's own URL); the first pull starts the round's clock. The
        body's `local_steps` is H; the reply's, this worker's (`pacing`)."""
        worker = self._worker_on(caller, block)
        with self.lock:
            now = self.clock()
            pulled = self.engine.pull(worker, block, now)
            view = pulled.view
            if view.done:
                raise refused(
                    "done", f"block {block} finished its {self.settings.max_rounds} rounds"
                )
            if pulled.started:
                self.ledger.round_started(block, view.round, now)
            self.traffic.mark_pull(worker, view.round, now)
            key = (view.version, view.round, view.deadline)
            cached = self._cache.get(block)
            if not with_body:
                cached = (key, b"")
            elif cached is None or cached[0] != key:
                meta = {
                    "block": block,
                    "version": view.version,
                    "round": view.round,
                    "deadline": "" if view.deadline is None else f"{view.deadline:.6f}",
                    "dtype": self.settings.wire_dtype,
                    "local_steps": self.settings.local_steps,
                }
                weights = self.blocks[block].weights
                cached = self._cache[block] = (key, encode(weights, meta, self.settings.wire_dtype))
            body = cached[1]
        deadline_in = None if view.deadline is None else view.deadline - now
        steps = self.settings.local_steps if pulled.local_steps is None else pulled.local_steps
        return PullReply(body, view, deadline_in, steps)

    def peek(self, block: int) -> dict[str, Any]:
        """The open round of a block, without side effects (for long polls)."""
        self.check_block(block)
        view = self.blocks[block].rounds.view()
        now = self.clock()
        return {
            "block": block,
            "round": view.round,
            "version": view.version,
            "deadline": view.deadline,
            "deadline_in": None if view.deadline is None else view.deadline - now,
            "done": view.done,
        }

    # ------------------------------------------------------------------ rounds

    def tick(self) -> list[Committed]:
        """Drop what tokens revoked or banned since the last tick left (`token revoke` and `ban`
        write the ledger from another process), close every round that is due, flush the traffic
        counters and, now and then, prune refused ledger rows."""
        with self.lock:
            now = self.clock()
            shut_out = self.ledger.shut_out_tokens()
            new = {t: why for t, why in shut_out.items() if t not in self._shut_out}
            self.durable.drop_tokens(self.engine, new, now)
            self._shut_out = set(shut_out)
            committed = self.engine.tick(now)
        self.traffic.flush()
        if self._pruned_at is None or now - self._pruned_at >= self.limits.prune_every_s:
            self._pruned_at = now
            self.ledger.prune_refused(self.limits.keep_refused)
        return committed

    def flush_traffic(self) -> None:
        self.traffic.flush()

    def close(self) -> None:
        """Stop the live evaluation's thread (the state folder stays open: its owner's)."""
        if self.evaluations is not None:
            self.evaluations.close()


def open_service(
    storage: StateDir, settings: AggregatorSettings | None = None, clock: Clock = time.time
) -> AggregatorService:
    """A service over an initialised state folder (ProtocolError when it is not)."""
    if not storage.initialised:
        raise ProtocolError(f"{storage.root} holds no aggregator state")
    return AggregatorService(settings, storage=storage, clock=clock)
