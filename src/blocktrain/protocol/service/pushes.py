"""The push path of the aggregator's service (`Pushes.submit`; a mixin of `AggregatorService`,
on `Admission`, which says who may push to which block):

1. identity, rate, worker, block and probe budget, before the body is read;
2. form: `RoundEngine.inspect`, outside the lock;
3. timing under the lock: `judge`, the replay `screen`, a place at the probe;
4. effect: `finish` (the probe, one at a time), outside the engine's lock; the body is written
   to STATE/pending and fsynced;
5. timing again under the lock (the round may have closed meanwhile): if accepted, a ledger row,
   `record` and `tick`; else the pending file goes;
6. the row is fsynced after the lock (one fsync covers concurrent pushes), then the answer.

A refused push of a known token gets a ledger row before its 4xx; earlier refusals are counted
in memory only, so that no one who merely reaches the port fills the disk."""

from __future__ import annotations

import threading
from typing import Any, NoReturn

from blocktrain.protocol.core.events import Checked, EngineBlock, ProbeSlot
from blocktrain.protocol.core.verdict import Verdict, refused
from blocktrain.protocol.service.admission import Admission
from blocktrain.protocol.service.updates import PushContext, update_fields
from blocktrain.protocol.store.ledger_schema import fsync_wal
from blocktrain.protocol.store.persist import Durable
from blocktrain.protocol.store.storage import StateDir


class Pushes(Admission):
    """An update's way from its body to accepted or refused, over the service's state."""

    storage: StateDir
    durable: Durable
    blocks: dict[int, EngineBlock]
    lock: threading.RLock
    probe_lock: threading.Lock

    def submit(self, ctx: PushContext, body: bytes | bytearray) -> dict[str, Any]:
        """Check, store and judge one update; returns the acceptance or raises Refused."""
        checked = self.engine.inspect(ctx.block, body)
        meta = checked.meta
        fields = {} if meta is None else update_fields(meta, checked)
        if not checked.verdict.accepted:
            self._refused(ctx, checked, checked.verdict, body, fields)
        assert meta is not None
        with self.lock:  # the cheap checks first: no probe for a duplicate or late update
            verdict = self.engine.judge(ctx.worker_id, ctx.block, meta, self.clock())
            if verdict.accepted:
                verdict = self.engine.screen(ctx.worker_id, ctx.block, checked)
            slot = None
            if verdict.accepted:
                verdict, slot = self.engine.reserve_probe(ctx.worker_id, ctx.block)
        if not verdict.accepted:
            self._refused(ctx, checked, verdict, body, fields)
        try:
            if slot is not None:  # the probe: one update at a time, a bounded queue before it
                with self.probe_lock:
                    checked = self.engine.finish(checked, ctx.worker_id)
            else:
                checked = self.engine.finish(checked, ctx.worker_id)
        except BaseException:
            with self.lock:
                self.engine.release_probe(slot, accepted=False)
            raise
        fields = update_fields(meta, checked)
        if not checked.verdict.accepted:
            self._refused(ctx, checked, checked.verdict, body, fields, slot)
        try:
            name = self.storage.write_pending(ctx.block, body)  # durable before it is accepted
        except BaseException:
            with self.lock:
                self.engine.release_probe(slot, accepted=True)
            raise
        with self.lock:
            now = self.clock()
            verdict = self.engine.judge(ctx.worker_id, ctx.block, meta, now)
            if verdict.accepted:  # a copy pushed while this one was probed
                screened = self.engine.screen(ctx.worker_id, ctx.block, checked)
                verdict = verdict if screened.accepted else screened
            self.engine.release_probe(slot, accepted=verdict.accepted)
            if not verdict.accepted:
                self.storage.remove_pending(name)
                self.engine.record(ctx.worker_id, ctx.block, verdict, now, checked=checked)
                self._refuse(ctx, checked, verdict.reason, verdict.detail, body, fields)
                self.engine.tick(now)
            else:
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
                    sync=False,  # fsynced below, outside the lock: concurrent pushes share fsyncs
                    **fields,
                )
                self.durable.pending[ctx.block][update_id] = name
                started = self.engine.record(
                    ctx.worker_id, ctx.block, verdict, now, checked=checked, update_id=update_id
                )
                if started:  # so that a restart restores the round's deadline
                    self.ledger.round_started(ctx.block, self.blocks[ctx.block].rounds.round, now)
                self.engine.tick(now)
        fsync_wal(self.ledger.path)  # the row (accepted or refused) is durable before the answer
        if not verdict.accepted:
            raise refused(verdict.reason, verdict.detail)
        return {
            "accepted": True,
            "update_id": update_id,
            "round": meta.round,
            "counts_in": verdict.counts_in,
            "weight": verdict.weight,
            "norm": fields["norm"],
        }

    def _refused(
        self,
        ctx: PushContext,
        checked: Checked,
        verdict: Verdict,
        body: bytes | bytearray,
        fields: dict[str, Any],
        slot: ProbeSlot | None = None,
    ) -> NoReturn:
        """Record a refused update (its ledger row, its report in the round, its reputation)
        and raise the refusal; `slot`: its place at the probe, given back spent."""
        with self.lock:
            now = self.clock()
            self.engine.release_probe(slot, accepted=False)
            self.engine.record(ctx.worker_id, ctx.block, verdict, now, checked=checked)
            self._refuse(ctx, checked, verdict.reason, verdict.detail, body, fields)
            self.engine.tick(now)
        # the row is durable before the refusal goes out, but fsynced outside the lock: every
        # status, pull and push takes it, and a token's stream of refused pushes (one fsync
        # each) held it for most of every second (bench/live_attacks.py, push_flood)
        fsync_wal(self.ledger.path)
        raise refused(verdict.reason, verdict.detail)

    def _refuse(
        self,
        ctx: PushContext,
        checked: Checked,
        reason: str,
        detail: str,
        body: bytes | bytearray,
        fields: dict[str, Any],
    ) -> None:
        """Its ledger row, not yet fsynced: the caller holds the lock, and fsyncs after it."""
        exc = refused(reason, detail)
        size = len(body)
        self._record_refusal(
            ctx.received, ctx.token_id, ctx.worker_id, ctx.block, exc, size, sync=False, **fields
        )
