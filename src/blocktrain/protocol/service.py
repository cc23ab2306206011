"""The aggregator's service functions: everything the HTTP routes do, without HTTP.

Keyword-only functions over one `AggregatorService` (state folder, ledger, round state machines,
accumulators); the routes in `aggregator.py` only read requests and write responses. Time comes
from the injected `clock` (seconds since the epoch by default, so deadlines survive a restart);
the round logic itself is `rounds.BlockRounds`, which never reads a clock.

An update is handled in four steps:

1. identity: token, worker, its block, the declared size (`begin_push`);
2. content: safetensors parse and the validator chain (`validation`), outside the lock;
3. durability: the body is written to STATE/pending and fsynced, still outside the lock;
4. timing: under the lock, the round verdict (`BlockRounds.judge`); if accepted, a ledger row,
   the accumulator and perhaps an early close; else the pending file is removed.

Every refusal, at any step, gets a ledger row with its reason before the 4xx goes out.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from blocktrain.errors import ProtocolError, Refused
from blocktrain.protocol.aggregation import Accumulator, OuterOptimizer
from blocktrain.protocol.ledger import NONE_KEY, TokenRow, WorkerRow
from blocktrain.protocol.rounds import (
    BlockRounds,
    Contribution,
    Registry,
    RoundClosed,
    RoundPolicy,
    RoundView,
    restore,
)
from blocktrain.protocol.settings import AggregatorSettings
from blocktrain.protocol.storage import StateDir
from blocktrain.protocol.tokens import bearer, hash_token
from blocktrain.protocol.validation import BlockSpec, Candidate, Limits, validate
from blocktrain.protocol.verdict import REASONS, Verdict
from blocktrain.protocol.wire import WireError, decode, encode

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
Clock = Callable[[], float]

NOT_A_REPORT = frozenset({"duplicate", "future_round", "done"})
"""Refusals that do not count as a replica reporting for its round."""


def refused(reason: str, detail: str = "") -> Refused:
    return Refused(reason, detail or REASONS[reason][1], REASONS[reason][0])


@dataclass
class BlockState:
    """One block as the aggregator holds it."""

    index: int
    weights: Tensors
    momentum: Tensors | None
    spec: BlockSpec
    rounds: BlockRounds
    acc: Accumulator
    pending: dict[int, str] = field(default_factory=dict)
    """update id -> pending body file, for the open round's accepted updates."""
    cache: tuple[tuple[int, int, float | None], bytes] | None = None
    """(version, round, deadline) -> the encoded body of the last pull."""


@dataclass(frozen=True)
class Caller:
    token_id: int
    token_name: str
    worker_id: int | None


@dataclass(frozen=True)
class PushContext:
    received: float
    token_id: int
    worker_id: int
    block: int


@dataclass(frozen=True)
class Pulled:
    body: bytes
    view: RoundView
    deadline_in: float | None


class AggregatorService:
    """The aggregator without HTTP. Thread-safe: one lock guards the round state."""

    def __init__(
        self,
        settings: AggregatorSettings | None = None,
        *,
        storage: StateDir,
        clock: Clock = time.time,
    ) -> None:
        self.storage = storage
        manifest = storage.manifest()
        self.settings = settings if settings is not None else storage.settings()
        self.run_config: dict[str, Any] = dict(manifest["run_config"])
        self.n_blocks = int(manifest["blocks"])
        self.clock = clock
        self.ledger = storage.ledger
        s = self.settings
        self.policy = RoundPolicy(s.deadline_s, s.staleness, s.stale_weight, s.max_rounds)
        self.outer = OuterOptimizer(s.outer_lr, s.outer_momentum)
        self.limits = Limits(s.max_delta_norm, s.max_tokens)
        self.registry = Registry(self.n_blocks, s.live_window)
        self.listeners: list[Callable[[int], None]] = []
        """Called with the block index after each commit (from the committing thread)."""
        self._lock = threading.RLock()
        self._traffic: dict[tuple[str, int, int], list[int]] = {}
        self._pulls: dict[int, tuple[int, float]] = {}
        """worker -> (round, time) of pulls not yet in the ledger (flushed with the traffic)."""
        self._traffic_lock = threading.Lock()
        self.started_at = clock()
        self.blocks: dict[int, BlockState] = {}
        self._restore()
        largest = max(st.spec.n_params for st in self.blocks.values())
        self.max_body = s.max_body_bytes or 2 * 4 * largest + (1 << 20)
        self.tick()

    # ------------------------------------------------------------------ restore

    def _restore(self) -> None:
        workers = self.ledger.workers(active_only=True)
        for w in workers:
            self.registry.add(w.id, w.block, w.last_seen)
        referenced: set[str] = set()
        for b in range(self.n_blocks):
            st = self._restore_block(b, [w for w in workers if w.block == b])
            self.blocks[b] = st
            referenced.update(st.pending.values())
        for name in self.storage.pending_names():  # bodies written before a crash, never accepted
            if name not in referenced:
                self.storage.remove_pending(name)

    def _restore_block(self, b: int, workers: list[WorkerRow]) -> BlockState:
        version, round_, started_at = self.ledger.block_state(b)
        weights = self.storage.load_tensors(b, version)
        momentum = None
        if self.outer.stateful and self.storage.has_tensors(b, version, "m"):
            momentum = self.storage.load_tensors(b, version, "m")
        spec = BlockSpec.of(weights, self.settings.wire_dtype)
        rows = [
            u
            for u in self.ledger.updates(block=b, round=round_)
            if u.worker_id is not None and u.reason not in NOT_A_REPORT
        ]
        prev = {
            u.worker_id
            for u in self.ledger.updates(block=b, round=round_ - 1)
            if u.worker_id is not None and u.reason not in NOT_A_REPORT
        }
        acc = Accumulator(self.settings.rule, self.settings.trim)
        contributions: list[Contribution] = []
        pending: dict[int, str] = {}
        for u in self.ledger.open_accepted(b):
            if u.pending is None or u.worker_id is None or u.round is None:
                continue
            try:
                body = self.storage.read_pending(u.pending)
            except OSError:
                log.error("block %d: accepted update %d lost its body %s", b, u.id, u.pending)
                continue
            delta = decode(body).to_torch()
            weight = float(u.weight or 1.0)
            acc.add(delta, weight * int(u.tokens or 1))
            contributions.append(
                Contribution(u.id, u.worker_id, int(u.tokens or 1), weight, u.round)
            )
            pending[u.id] = u.pending
        published = {
            r["round"]: r["base_version"]
            for r in self.ledger.rounds(b)
            if r["round"] >= round_ - self.policy.staleness
        }
        published[round_] = version
        state = restore(
            b,
            self.policy,
            round=round_,
            version=version,
            started_at=started_at,
            assigned=[w.id for w in workers],
            pulled=[w.id for w in workers if w.pulled_round == round_],
            reported={u.worker_id for u in rows if u.worker_id is not None},
            prev_reported={w for w in prev if w is not None},
            accepted=contributions,
            refused=sum(1 for u in rows if u.fate == "refused"),
            published=published,
        )
        if contributions:
            log.info(
                "block %d: resumed round %d at version %d with %d accepted update(s)",
                b,
                round_,
                version,
                len(contributions),
            )
        return BlockState(b, weights, momentum, spec, state, acc, pending)

    # ------------------------------------------------------------------ identity

    def authenticate(self, authorization: str | None) -> TokenRow:
        token = bearer(authorization)
        if isinstance(token, Verdict):
            raise refused(token.reason, token.detail)
        row = self.ledger.token_by_hash(hash_token(token))
        if row is None:
            raise refused("invalid_token", "this token is not known to the aggregator")
        if row.revoked is not None:
            raise refused("revoked_token", f"token {row.name!r} was revoked")
        return row

    def identify(self, authorization: str | None, worker_header: str | None) -> Caller:
        """The token and, when there is one, the worker making the call (the X-Worker-Id
        header, else the token's latest registered worker)."""
        token = self.authenticate(authorization)
        if worker_header is not None and worker_header.strip():
            try:
                worker_id = int(worker_header)
            except ValueError:
                raise refused(
                    "unknown_worker", f"X-Worker-Id {worker_header[:40]!r} is not a worker id"
                ) from None
            row = self.ledger.worker(worker_id)
            if row is None or row.left_at is not None:
                raise refused(
                    "unknown_worker", f"worker {worker_id} is not registered; register again"
                )
            if row.token_id != token.id:
                raise refused("not_your_worker", f"worker {worker_id} belongs to another token")
            return Caller(token.id, token.name, worker_id)
        latest = self.ledger.latest_worker_of(token.id)
        return Caller(token.id, token.name, None if latest is None else latest.id)

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.n_blocks:
            raise refused("unknown_block", f"block {block} is outside 0..{self.n_blocks - 1}")

    # ------------------------------------------------------------------ workers

    def register(
        self, *, authorization: str | None, block: int | None = None, name: str | None = None
    ) -> dict[str, Any]:
        token = self.authenticate(authorization)
        if block is not None:
            self._check_block(block)
        with self._lock:
            now = self.clock()
            self._tick_locked(now)
            done = [b for b, st in self.blocks.items() if st.rounds.done]
            chosen = self.registry.choose_block(now, block, exclude=done)
            worker_id = self.ledger.add_worker(token.id, chosen, name, now)
            self.registry.add(worker_id, chosen, now)
            st = self.blocks[chosen]
            st.rounds.assign(worker_id)
            view = st.rounds.view()
        log.info("worker %d (%s) registered on block %d", worker_id, token.name, chosen)
        seed = int(self.run_config.get("seed", 0))
        return {
            "worker_id": worker_id,
            "block": chosen,
            "data_seed": seed * self.settings.n_workers + worker_id,
            "local_steps": self.settings.local_steps,
            "round": view.round,
            "version": view.version,
            "wire_dtype": self.settings.wire_dtype,
            "done": view.done,
        }

    def leave(self, *, authorization: str | None, worker_id: int) -> dict[str, Any]:
        caller = self.identify(authorization, str(worker_id))
        assert caller.worker_id is not None
        with self._lock:
            now = self.clock()
            block = self.registry.block_of(caller.worker_id)
            self.ledger.worker_left(caller.worker_id, now)
            self.registry.remove(caller.worker_id)
            if block is not None:
                self.blocks[block].rounds.unassign(caller.worker_id)
            self._tick_locked(now)
        log.info("worker %d left", caller.worker_id)
        return {"worker_id": caller.worker_id, "left": True}

    def config(self, *, authorization: str | None) -> dict[str, Any]:
        self.authenticate(authorization)
        return {
            "run_config": self.run_config,
            "protocol": {**self.settings.to_dict(), "max_body_bytes": self.max_body},
            "blocks": self.n_blocks,
            "tensors": {
                str(b): {k: list(v) for k, v in st.spec.shapes.items()}
                for b, st in self.blocks.items()
            },
        }

    # ------------------------------------------------------------------ pulls

    def _worker_on(self, caller: Caller, block: int) -> int:
        if caller.worker_id is None:
            raise refused(
                "unknown_worker", "this token has no registered worker; POST /v1/workers first"
            )
        self._check_block(block)
        assigned = self.registry.block_of(caller.worker_id)
        if assigned != block:
            raise refused(
                "not_assigned",
                f"worker {caller.worker_id} is assigned to block {assigned}, not {block}",
            )
        return caller.worker_id

    def pull(self, *, authorization: str | None, worker_header: str | None, block: int) -> Pulled:
        """The open round's weights in the wire dtype; the first pull starts the round's
        clock."""
        worker = self._worker_on(self.identify(authorization, worker_header), block)
        with self._lock:
            now = self.clock()
            self._tick_locked(now)
            st = self.blocks[block]
            if st.rounds.done:
                raise refused("done", f"block {block} finished its {self.policy.max_rounds} rounds")
            started = st.rounds.started_at is not None
            view = st.rounds.pull(worker, now)
            self.registry.seen(worker, now)
            if not started and view.deadline is not None:
                self.ledger.round_started(block, view.round, now)
            with self._traffic_lock:
                self._pulls[worker] = (view.round, now)
            key = (view.version, view.round, view.deadline)
            if st.cache is None or st.cache[0] != key:
                meta = {
                    "block": block,
                    "version": view.version,
                    "round": view.round,
                    "deadline": "" if view.deadline is None else f"{view.deadline:.6f}",
                    "dtype": self.settings.wire_dtype,
                    "local_steps": self.settings.local_steps,
                }
                st.cache = (key, encode(st.weights, meta, self.settings.wire_dtype))
            body = st.cache[1]
        deadline_in = None if view.deadline is None else view.deadline - now
        return Pulled(body, view, deadline_in)

    def peek(self, block: int) -> dict[str, Any]:
        """The open round of a block, without side effects (for long polls)."""
        self._check_block(block)
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

    # ------------------------------------------------------------------ pushes

    def begin_push(
        self,
        *,
        authorization: str | None,
        worker_header: str | None,
        block: int,
        content_length: int | None,
    ) -> PushContext:
        """Who is pushing, to which block, and how much: refused (with a ledger row) before a
        byte of the body is read."""
        received = self.clock()
        token_id: int | None = None
        worker: int | None = None
        try:
            caller = self.identify(authorization, worker_header)
            token_id, worker = caller.token_id, caller.worker_id
            worker = self._worker_on(caller, block)
            if content_length is not None and content_length > self.max_body:
                raise refused(
                    "too_large",
                    f"the body declares {content_length} bytes; the limit is {self.max_body}",
                )
        except Refused as exc:
            self._record_refusal(received, token_id, worker, block, exc, content_length or 0)
            raise
        return PushContext(received, caller.token_id, worker, block)

    def refuse_push(self, ctx: PushContext, reason: str, detail: str, size: int) -> Refused:
        exc = refused(reason, detail)
        self._record_refusal(ctx.received, ctx.token_id, ctx.worker_id, ctx.block, exc, size)
        return exc

    def _record_refusal(
        self,
        received: float,
        token_id: int | None,
        worker: int | None,
        block: int | None,
        exc: Refused,
        size: int,
        **fields: Any,
    ) -> None:
        known_block = block if block is not None and 0 <= block < self.n_blocks else None
        self.ledger.record_update(
            received=received,
            bytes=size,
            fate="refused",
            token_id=token_id,
            worker_id=worker,
            block=known_block,
            reason=exc.reason,
            detail=exc.detail,
            **fields,
        )
        log.info(
            "refused an update for block %s from worker %s: %s (%s)",
            block,
            worker,
            exc.reason,
            exc.detail,
        )

    def submit(self, ctx: PushContext, body: bytes) -> dict[str, Any]:
        """Validate, store and judge one update; returns the acceptance or raises Refused."""
        st = self.blocks[ctx.block]
        try:
            decoded = decode(body, max_bytes=self.max_body)
        except WireError as exc:
            raise self.refuse_push(ctx, exc.reason, exc.detail, len(body)) from None
        candidate = Candidate(ctx.block, decoded, st.spec, self.limits)
        verdict = validate(candidate)
        meta = candidate.meta
        if not verdict.accepted:
            refusal = refused(verdict.reason, verdict.detail)
            with self._lock:
                now = self.clock()
                fields: dict[str, Any] = {}
                if meta is not None:
                    fields = _update_fields(meta, candidate.norm)
                    st.rounds.record(ctx.worker_id, verdict, round=meta.round, now=now)
                self._record_refusal(
                    ctx.received,
                    ctx.token_id,
                    ctx.worker_id,
                    ctx.block,
                    refusal,
                    len(body),
                    **fields,
                )
                self._tick_locked(now)
            raise refusal
        assert meta is not None and candidate.norm is not None
        name = self.storage.write_pending(ctx.block, body)  # durable before it is accepted
        with self._lock:
            now = self.clock()
            self._tick_locked(now)
            verdict = st.rounds.judge(
                ctx.worker_id, round=meta.round, base_version=meta.base_version, now=now
            )
            common = _update_fields(meta, candidate.norm)
            if not verdict.accepted:
                self.storage.remove_pending(name)
                st.rounds.record(ctx.worker_id, verdict, round=meta.round, now=now)
                refusal = refused(verdict.reason, verdict.detail)
                self._record_refusal(
                    ctx.received,
                    ctx.token_id,
                    ctx.worker_id,
                    ctx.block,
                    refusal,
                    len(body),
                    **common,
                )
                self._tick_locked(now)
                raise refusal
            update_id = self.ledger.record_update(
                received=ctx.received,
                bytes=len(body),
                fate="accepted",
                token_id=ctx.token_id,
                worker_id=ctx.worker_id,
                block=ctx.block,
                weight=verdict.weight,
                counts_in=verdict.counts_in,
                pending=name,
                seen=now,
                **common,
            )
            st.rounds.record(
                ctx.worker_id,
                verdict,
                round=meta.round,
                now=now,
                update_id=update_id,
                tokens=meta.tokens,
            )
            st.pending[update_id] = name
            st.acc.add(candidate.tensors, verdict.weight * meta.tokens)
            self.registry.seen(ctx.worker_id, now)
            self._tick_locked(now)
        return {
            "accepted": True,
            "update_id": update_id,
            "round": meta.round,
            "counts_in": verdict.counts_in,
            "weight": verdict.weight,
            "norm": candidate.norm,
        }

    # ------------------------------------------------------------------ rounds

    def tick(self) -> list[RoundClosed]:
        """Close every round whose deadline passed (the aggregator calls this a few times a
        second) and flush the traffic counters."""
        with self._lock:
            closed = self._tick_locked(self.clock())
        self.flush_traffic()
        return closed

    def _tick_locked(self, now: float) -> list[RoundClosed]:
        closed = []
        for st in self.blocks.values():
            result = st.rounds.tick(now)
            if result is not None:
                self._commit(st, result)
                closed.append(result)
        return closed

    def _commit(self, st: BlockState, closed: RoundClosed) -> None:
        """Aggregate, write the new version atomically, then record the round in the ledger
        (a crash between the two leaves the round open, to be closed again on restart)."""
        delta = st.acc.result()
        weights, momentum = st.weights, st.momentum
        if delta is not None:
            weights, momentum = self.outer.apply(st.weights, delta, st.momentum)
            self.storage.save_tensors(st.index, closed.new_version, weights)
            if momentum is not None:
                self.storage.save_tensors(st.index, closed.new_version, momentum, kind="m")
        ids = [c.update_id for c in closed.accepted]
        self.ledger.commit_round(
            block=st.index,
            round=closed.round,
            base_version=closed.base_version,
            new_version=closed.new_version,
            started_at=closed.started_at,
            deadline=closed.deadline,
            closed_at=closed.closed_at,
            cause=closed.cause,
            refused=closed.refused,
            expected=len(closed.expected),
            reported=len(closed.reported),
            update_ids=ids,
        )
        st.weights, st.momentum = weights, momentum
        st.acc = Accumulator(self.settings.rule, self.settings.trim)
        for uid in ids:
            name = st.pending.pop(uid, None)
            if name is not None:
                self.storage.remove_pending(name)
        self.storage.prune(st.index, closed.new_version, self.settings.keep_versions)
        log.info(
            "block %d round %d closed (%s): %d accepted, %d refused, %d/%d reported; version %d",
            st.index,
            closed.round,
            closed.cause,
            len(ids),
            closed.refused,
            len(closed.reported),
            len(closed.expected),
            closed.new_version,
        )
        for listener in self.listeners:
            listener(st.index)

    # ------------------------------------------------------------------ accounting

    def account(
        self, endpoint: str, block: int | None, worker: int | None, bytes_in: int, bytes_out: int
    ) -> None:
        key = (
            endpoint,
            NONE_KEY if block is None else block,
            NONE_KEY if worker is None else worker,
        )
        with self._traffic_lock:
            row = self._traffic.setdefault(key, [0, 0, 0])
            row[0] += 1
            row[1] += bytes_in
            row[2] += bytes_out

    def flush_traffic(self) -> None:
        """Write the byte counters and the batched pull marks to the ledger."""
        with self._traffic_lock:
            rows = [
                (ep, b, w, vals[0], vals[1], vals[2]) for (ep, b, w), vals in self._traffic.items()
            ]
            self._traffic = {}
            pulls, self._pulls = self._pulls, {}
        self.ledger.workers_pulled((w, r, now) for w, (r, now) in pulls.items())
        try:
            self.ledger.add_traffic(rows)
        except Exception:
            with self._traffic_lock:  # keep the counts for the next flush
                for ep, b, w, n, i, o in rows:
                    row = self._traffic.setdefault((ep, b, w), [0, 0, 0])
                    row[0] += n
                    row[1] += i
                    row[2] += o
            raise

    def traffic_summary(self) -> dict[str, Any]:
        self.flush_traffic()
        by_endpoint: dict[str, dict[str, int]] = {}
        by_block: dict[str, dict[str, int]] = {}
        by_worker: dict[str, dict[str, int]] = {}
        total_in = total_out = 0
        for r in self.ledger.traffic():
            total_in += r["bytes_in"]
            total_out += r["bytes_out"]
            for table, key in (
                (by_endpoint, r["endpoint"]),
                (by_block, str(r["block"])),
                (by_worker, str(r["worker_id"])),
            ):
                if key == str(NONE_KEY) and table is not by_endpoint:
                    continue
                entry = table.setdefault(key, {"requests": 0, "bytes_in": 0, "bytes_out": 0})
                entry["requests"] += r["requests"]
                entry["bytes_in"] += r["bytes_in"]
                entry["bytes_out"] += r["bytes_out"]
        return {
            "bytes_in": total_in,
            "bytes_out": total_out,
            "total": total_in + total_out,
            "by_endpoint": by_endpoint,
            "by_block": by_block,
            "by_worker": by_worker,
        }

    # ------------------------------------------------------------------ status and metrics

    def status(self, *, authorization: str | None, last_rounds: int = 20) -> dict[str, Any]:
        self.authenticate(authorization)
        return self.snapshot(last_rounds=last_rounds)

    def snapshot(self, *, last_rounds: int = 20) -> dict[str, Any]:
        """Everything /v1/status shows (no authentication: for the CLI and tests)."""
        now = self.clock()
        with self._lock:
            live = self.registry.live(now)
            entries = dict(self.registry.workers)
            blocks = []
            for b, st in self.blocks.items():
                r = st.rounds
                blocks.append(
                    {
                        "block": b,
                        "round": r.round,
                        "version": r.version,
                        "deadline": r.deadline,
                        "deadline_in": None if r.deadline is None else r.deadline - now,
                        "done": r.done,
                        "expected": sorted(r.expected()),
                        "reported": sorted(r.reported),
                        "pending_accepted": len(r.accepted),
                        "assigned": sorted(r.assigned),
                        "live_replicas": sum(1 for blk in live.values() if blk == b),
                        "params": st.spec.n_params,
                        "wire_bytes": st.spec.wire_bytes,
                    }
                )
        counts = self.ledger.worker_counts()
        workers = [
            {
                "worker_id": w,
                "block": e.block,
                "live": w in live,
                "last_seen_s": now - e.last_seen,
                "accepted": counts.get(w, {}).get("accepted", 0),
                "refused": counts.get(w, {}).get("refused", 0),
            }
            for w, e in sorted(entries.items())
        ]
        by_reason: dict[str, int] = {}
        accepted_total = refused_total = 0
        for row in self.ledger.update_counts():
            if row["fate"] == "accepted":
                accepted_total += row["n"]
            else:
                refused_total += row["n"]
                by_reason[row["reason"]] = by_reason.get(row["reason"], 0) + row["n"]
        part: dict[str, list[dict[str, Any]]] = {}
        for row in self.ledger.rounds(last=last_rounds):
            part.setdefault(str(row["block"]), []).append(
                {
                    "round": row["round"],
                    "accepted": row["accepted"],
                    "refused": row["refused"],
                    "expected": row["expected"],
                    "reported": row["reported"],
                    "cause": row["cause"],
                    "version": row["new_version"],
                    "participation": (row["accepted"] / row["expected"])
                    if row["expected"]
                    else float(row["accepted"] > 0),
                    "duration_s": None
                    if row["started_at"] is None
                    else row["closed_at"] - row["started_at"],
                }
            )
        return {
            "time": now,
            "uptime_s": now - self.started_at,
            "blocks": blocks,
            "versions": [b["version"] for b in blocks],
            "rounds": [b["round"] for b in blocks],
            "done": all(b["done"] for b in blocks),
            "workers": {
                "registered": len(entries),
                "live": len(live),
                "per_block": self.registry.live_per_block(now),
                "list": workers,
            },
            "participation": part,
            "updates": {
                "accepted": accepted_total,
                "refused": refused_total,
                "refused_by_reason": by_reason,
            },
            "bytes": self.traffic_summary(),
            "settings": {**self.settings.to_dict(), "max_body_bytes": self.max_body},
        }

    def metrics(self) -> str:
        """Prometheus text exposition format, version 0.0.4."""
        snap = self.snapshot(last_rounds=1)
        out: list[str] = []

        def metric(
            name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any], float]]
        ) -> None:
            out.append(f"# HELP blocktrain_{name} {help_}")
            out.append(f"# TYPE blocktrain_{name} {kind}")
            for labels, value in samples:
                text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                out.append(
                    f"blocktrain_{name}{{{text}}} {_num(value)}"
                    if text
                    else f"blocktrain_{name} {_num(value)}"
                )

        blocks = snap["blocks"]
        metric(
            "block_version",
            "gauge",
            "Committed version of each block.",
            [({"block": b["block"]}, b["version"]) for b in blocks],
        )
        metric(
            "block_round",
            "gauge",
            "Open round of each block.",
            [({"block": b["block"]}, b["round"]) for b in blocks],
        )
        metric(
            "block_pending_updates",
            "gauge",
            "Accepted updates waiting in the open round.",
            [({"block": b["block"]}, b["pending_accepted"]) for b in blocks],
        )
        metric(
            "live_workers",
            "gauge",
            "Workers heard from within the live window.",
            [({"block": b["block"]}, b["live_replicas"]) for b in blocks],
        )
        last = [(int(k), v[-1]) for k, v in snap["participation"].items() if v]
        metric(
            "round_participation",
            "gauge",
            "Accepted over expected replicas in the last closed round.",
            [({"block": b}, r["participation"]) for b, r in last],
        )
        samples = [
            (
                {
                    "block": "" if r["block"] is None else r["block"],
                    "fate": r["fate"],
                    "reason": r["reason"],
                },
                r["n"],
            )
            for r in self.ledger.update_counts()
        ]
        metric("updates_total", "counter", "Updates by block, fate and reason.", samples)
        by_ep = snap["bytes"]["by_endpoint"]
        metric(
            "requests_total",
            "counter",
            "Requests by endpoint.",
            [({"endpoint": ep}, v["requests"]) for ep, v in sorted(by_ep.items())],
        )
        metric(
            "bytes_total",
            "counter",
            "Body bytes by endpoint and direction.",
            [
                ({"endpoint": ep, "direction": d}, v[f"bytes_{d}"])
                for ep, v in sorted(by_ep.items())
                for d in ("in", "out")
            ],
        )
        metric(
            "uptime_seconds",
            "gauge",
            "Seconds since the aggregator started.",
            [({}, snap["uptime_s"])],
        )
        return "\n".join(out) + "\n"


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _update_fields(meta: Any, norm: float | None) -> dict[str, Any]:
    """The ledger columns an update's metadata fills, accepted or refused."""
    return {
        "round": meta.round,
        "base_version": meta.base_version,
        "tokens": meta.tokens,
        "loss": _finite(meta.loss),
        "norm": _finite(norm),
    }


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def open_service(
    storage: StateDir, settings: AggregatorSettings | None = None, clock: Clock = time.time
) -> AggregatorService:
    """A service over an initialised state folder (ProtocolError when it is not)."""
    if not storage.initialised:
        raise ProtocolError(f"{storage.root} holds no aggregator state")
    return AggregatorService(settings, storage=storage, clock=clock)
