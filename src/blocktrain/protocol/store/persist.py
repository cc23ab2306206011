"""The aggregator's durable state: the engine restored from the ledger and the state folder
after a (re)start, and each commit written to them. Pending bodies of the open round's accepted
updates are tracked here, so that a commit removes exactly those it aggregated."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

import torch

from blocktrain.protocol.core import codecs
from blocktrain.protocol.core.bodies import decode
from blocktrain.protocol.core.drift import Drifted
from blocktrain.protocol.core.effect import Reputation
from blocktrain.protocol.core.events import Committed, EngineBlock
from blocktrain.protocol.core.pacing import declared_steps, steps_share
from blocktrain.protocol.core.registry import Registry
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.rounds import NOT_A_REPORT, Contribution, RoundClosed, restore
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.store.ledger_schema import WorkerRow
from blocktrain.protocol.store.storage import StateDir

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class Durable:
    """Restore and commit over one state folder."""

    def __init__(self, storage: StateDir, settings: AggregatorSettings) -> None:
        self.storage = storage
        self.ledger = storage.ledger
        self.settings = settings
        self.n_blocks = storage.n_blocks()
        self.pending: dict[int, dict[int, str]] = {}
        """block -> update id -> pending body file, for the open round's accepted updates."""

    def restore(self, served: Collection[int]) -> RoundEngine:
        """The engine of the `served` blocks as the ledger and the state folder left it: each
        block's last committed version, its open round with the accepted updates, pulls, reports
        and deadline, and every identity's reputation. Bodies written but never accepted, and
        temporary files of interrupted writes, are removed. A block not served here is not
        loaded, so it opens no round and commits no version."""
        self.storage.remove_temporaries()
        workers = [w for w in self.ledger.workers(active_only=True) if w.block in served]
        registry = Registry(self.n_blocks, self.settings.live_window)
        for w in workers:
            registry.add(w.id, w.block, w.last_seen, w.token_id)
        standing = Reputation(self.settings.min_reputation, dict(self.ledger.reputations()))
        blocks = {
            b: self._restore_block(b, [w for w in workers if w.block == b], registry, standing)
            for b in sorted(served)
        }
        referenced = {name for pending in self.pending.values() for name in pending.values()}
        mine = {f"pending/{b}" for b in served}  # another block's bodies are not ours to judge
        for name in self.storage.pending_names():  # bodies written before a crash, never accepted
            if name not in referenced and name.rpartition("/")[0] in mine:
                self.storage.remove_pending(name)
        engine = RoundEngine(self.settings, blocks, registry, reputation=standing)
        engine.on_reputation.append(self.ledger.save_reputation)
        return engine

    def _restore_block(
        self, b: int, workers: list[WorkerRow], registry: Registry, standing: Reputation
    ) -> EngineBlock:
        version, round_, started_at = self.ledger.block_state(b)
        weights = self.storage.load_tensors(b, version)
        momentum = None
        if self.settings.outer_momentum > 0 and self.storage.has_tensors(b, version, "m"):
            momentum = self.storage.load_tensors(b, version, "m")
        remainder = None
        if self.settings.commit_codec is not None and self.storage.has_tensors(b, version, "r"):
            remainder = self.storage.load_tensors(b, version, "r")
        rows = [
            u
            for u in self.ledger.updates(block=b, round=round_)
            if u.worker_id is not None and u.reason not in NOT_A_REPORT
        ]
        reports = self.ledger.last_reports(b)
        rolled_back = self.ledger.rollbacks(b)
        prev = {
            u.worker_id
            for u in self.ledger.updates(block=b, round=round_ - 1)
            if u.worker_id is not None and u.reason not in NOT_A_REPORT
        }
        deltas: list[tuple[int, int, Tensors, float, int]] = []
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
            weight = float(u.weight or 1.0)
            parsed = decode(body)
            shapes = {k: tuple(v.shape) for k, v in weights.items()}
            delta = codecs.decode(parsed.tensors, shapes, codecs.declared(parsed.metadata))
            # the vote weighs the steps it took, as `RoundEngine.record` gave it (`pacing`)
            steps = steps_share(declared_steps(parsed.metadata), self.settings.local_steps)
            deltas.append((u.id, u.worker_id, delta, weight * steps, int(u.tokens or 1)))
            contributions.append(
                Contribution(u.id, u.worker_id, int(u.tokens or 1), weight, u.round)
            )
            pending[u.id] = u.pending
        # rounds up to a rollback published the weights it undid: no late update from them
        since = max([round_ - self.settings.staleness] + [r["round"] + 1 for r in rolled_back])
        published = {
            r["round"]: r["base_version"] for r in self.ledger.rounds(b) if r["round"] >= since
        }
        published[round_] = version
        rounds = restore(
            b,
            self.settings,
            round=round_,
            version=version,
            started_at=started_at,
            assigned=[w.id for w in workers],
            # Pull marks are written in batches (the ticker), so a crash can lose the last
            # ones: expect every assigned worker, or the first report would close the round
            # as "all_reported" before the others push. Silent ones still expire.
            pulled=[w.id for w in workers],
            reported={u.worker_id for u in rows if u.worker_id is not None},
            prev_reported={w for w in prev if w is not None},
            accepted=contributions,
            refused=sum(1 for u in rows if u.fate == "refused"),
            published=published,
            heard={w.id: max(w.registered, reports.get(w.id, w.registered)) for w in workers},
            report_times={
                w: min(u.received for u in rows if u.worker_id == w)
                for w in {u.worker_id for u in rows if u.worker_id is not None}
            },
        )
        st = RoundEngine.block(b, weights, momentum, self.settings, rounds, remainder)
        for uid, worker, delta, weight, tokens in deltas:
            identity = registry.identity(worker)
            # the ledger keeps the timing weight; the vote also carries the identity's standing,
            # as `RoundEngine.record` gave it
            weight *= standing.of(identity)
            st.acc.add(uid, delta, identity=identity, weight=weight, tokens=tokens)
        self.pending[b] = pending
        if contributions:
            log.info(
                "block %d: resumed round %d at version %d with %d accepted update(s)",
                b,
                round_,
                version,
                len(contributions),
            )
        return st

    def commit(self, event: Committed) -> None:
        """Write the new version atomically, then record the round in the ledger (a crash
        between the two leaves the round open, to be closed again on restart). Runs inside
        the engine's commit, before a pull can see the new weights."""
        closed = event.closed
        b = closed.block
        if event.changed:
            self.storage.save_tensors(b, closed.new_version, event.weights)
            if event.momentum is not None:
                self.storage.save_tensors(b, closed.new_version, event.momentum, kind="m")
            if event.remainder is not None:
                self.storage.save_tensors(b, closed.new_version, event.remainder, kind="r")
        ids = [c.update_id for c in closed.accepted]
        self.ledger.commit_round(
            block=b,
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
            held=event.held,
        )
        for uid in ids:
            name = self.pending[b].pop(uid, None)
            if name is not None:
                self.storage.remove_pending(name)
        self.storage.prune(b, closed.new_version, self.settings.keep_versions)
        if event.held:
            log.warning("block %d round %d: %s", b, closed.round, event.held)
        warn_drifted(closed, event.drifted)
        log.info(
            "block %d round %d closed (%s): %d accepted, %d refused, %d/%d reported; version %d",
            b,
            closed.round,
            closed.cause,
            len(ids),
            closed.refused,
            len(closed.reported),
            len(closed.expected),
            closed.new_version,
        )

    def drop_updates(
        self, engine: RoundEngine, block: int, ids: list[int], reason: str, detail: str
    ) -> None:
        """Accepted updates of the block's open round out of it: refused `reason` in the ledger
        first, then out of the engine's round, and their bodies gone."""
        if not ids:
            return
        self.ledger.drop_updates(ids, reason, detail)
        engine.discard(block, ids)
        for uid in ids:
            name = self.pending.get(block, {}).pop(uid, None)
            if name is not None:
                self.storage.remove_pending(name)

    def drop_tokens(self, engine: RoundEngine, shut_out: dict[int, str], now: float) -> None:
        """Tokens revoked or banned (token id -> the reason code): their accepted updates leave
        their open rounds (in the ledger first, then the engine) before their workers leave
        their blocks, since a leave may close a round, which must not count them."""
        if not shut_out:
            return
        open_ids = {uid: b for b, pending in self.pending.items() for uid in pending}
        owners = self.ledger.owners(open_ids)
        for token_id, reason in shut_out.items():
            ids = [uid for uid, owner in owners.items() if owner == token_id]
            detail = f"dropped from its round: the token was {reason.removesuffix('_token')}"
            for block in {open_ids[uid] for uid in ids}:
                mine = [uid for uid in ids if open_ids[uid] == block]
                self.drop_updates(engine, block, mine, reason, detail)
            workers = engine.registry.workers_of(token_id)
            for worker in workers:
                self.ledger.worker_left(worker, now)
                engine.leave(worker, now)
            if ids or workers:
                log.warning(
                    "token %d (%s): dropped %d pending update(s) and %d worker(s)",
                    token_id,
                    reason,
                    len(ids),
                    len(workers),
                )


def warn_drifted(closed: RoundClosed, drifted: Iterable[Drifted]) -> None:
    """The log line of each identity a round's drift observation flagged."""
    for d in drifted:
        log.warning(
            "block %d round %d: identity %s flagged for drift (score %.2f over %d votes): "
            "refused there until round %d",
            closed.block,
            closed.round,
            d.identity,
            d.score,
            d.votes,
            d.until,
        )
