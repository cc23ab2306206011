"""The round engine: every decision the aggregator takes, written once, in memory. Time is
always passed in; nothing here reads a clock, sleeps or does I/O. Two drivers share it:
`service.AggregatorService` (wall clock, persists each event, serves HTTP) and
`simulate.SimAggregator` (virtual clock, one process).

An update goes through `inspect` (its form), `judge` (its timing, read-only), then, with a
probe, `reserve_probe`, `finish` (its effect on the held-out loss) and `release_probe`, then
`record`; a driver persists what it must between `judge` and `record`, and calls `tick`
afterwards. The costly probe runs last, only for an update that passed every cheap check. A
round that closes is committed by `tick`: every `on_commit` listener sees the new weights (the
service writes them to disk there) before any pull can.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable
from functools import partial
from typing import cast

import torch

from blocktrain.protocol.core.aggregation import OuterOptimizer
from blocktrain.protocol.core.bodies import WireError, decode
from blocktrain.protocol.core.drift import Drifted, tracker
from blocktrain.protocol.core.effect import (
    EffectProbe,
    HonestBand,
    ProbeCache,
    Reputation,
    helped,
    judge_effect,
)
from blocktrain.protocol.core.events import (
    Checked,
    CommitListener,
    Committed,
    EngineBlock,
    PullEvent,
    Registered,
    ReputationListener,
    accumulator,
    max_body_bytes,
)
from blocktrain.protocol.core.pacing import Pacer
from blocktrain.protocol.core.probe_slots import ProbeSlots
from blocktrain.protocol.core.pulls import commit_step
from blocktrain.protocol.core.registry import Registry
from blocktrain.protocol.core.replays import ReplayScreen, SeenBodies, Sketcher
from blocktrain.protocol.core.rounds import BlockRounds, RoundClosed
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.validation import BlockSpec, Candidate, Limits, UpdateMeta, validate
from blocktrain.protocol.core.verdict import Verdict

Tensors = dict[str, torch.Tensor]


class RoundEngine(ReplayScreen, ProbeSlots):
    """Blocks, their rounds and accumulators, and the registry, fed with explicit times."""

    def __init__(
        self,
        settings: AggregatorSettings,
        blocks: dict[int, EngineBlock],
        registry: Registry | None = None,
        probe: EffectProbe | None = None,
        reputation: Reputation | None = None,
        seed: int | None = None,
    ) -> None:
        """`seed`: the sketches' secret (None: drawn; the simulator fixes it)."""
        seed = secrets.randbits(62) if seed is None else seed
        self.settings = settings
        self.blocks = blocks
        self.registry = registry or Registry(len(blocks), settings.live_window)
        self.probe: ProbeCache | None = None
        self.use_probe(probe)
        self.reputation = Reputation(settings.min_reputation) if reputation is None else reputation
        self.bands: dict[int, HonestBand] = {}
        """Each block's recent accepted effects (empty after a restart: it refills)."""
        self.drift = tracker(settings, seed)
        """Each identity's lean against the other votes of its block (`drift`; in memory)."""
        self.drift_later: Callable[[RoundClosed, Callable[[], list[Drifted]]], None] | None = None
        """Runs a commit's drift observation, given the round and it; None: inside the commit
        (the service's: on a thread of its own, `service/drift_jobs.py`, then `penalise`)."""
        self.observing: set[int] = set()
        """Blocks whose last commit `drift_later` observes: their open round does not close
        before its flags are in (`drift_jobs`: they drop a flagged identity's updates)."""
        self._auto_id = 0  # ids for updates recorded without one (the simulator has no ledger)
        self.outer = OuterOptimizer(settings.outer_lr, settings.outer_momentum)
        self.limits = Limits(settings.max_delta_norm, settings.max_tokens)
        self.max_body = max_body_bytes(settings, max(st.spec.n_params for st in blocks.values()))
        self.on_commit: list[CommitListener] = []
        """Called with each commit before its weights are published."""
        self.on_reputation: list[ReputationListener] = []
        self._probe_spent: dict[int, tuple[int, Counter[Hashable]]] = {}
        """block -> (its open round, the probe places each identity holds or spent in it)."""
        self.probing = 0
        """Updates holding a place at the probe now (at most PROBE_SLOTS)."""
        self.sketcher = Sketcher(seed)
        self.seen: dict[int, SeenBodies] = {b: SeenBodies() for b in blocks}
        """Each block's recent bodies' sketches (the last `replay_rounds` rounds, at most
        REPLAY_ENTRIES; in memory: a restart empties it)."""
        self.pulled: dict[int, tuple[int, int, int]] = {}
        """worker -> (block, round, version) of its last pull (in memory)."""
        self.pacer = Pacer(settings)

    def use_probe(self, probe: EffectProbe | None) -> None:
        """Judge updates by their effect with `probe` (unless the setting turns it off)."""
        on = probe is not None and self.settings.effect_probe == "on"
        self.probe = ProbeCache(probe) if on and probe is not None else None

    @classmethod
    def fresh(
        cls,
        initial: dict[int, Tensors],
        settings: AggregatorSettings,
        probe: EffectProbe | None = None,
        seed: int | None = None,
    ) -> RoundEngine:
        """Version 0 of every block, round 0, no workers."""
        blocks = {
            b: cls.block(b, {k: v.detach().float().clone() for k, v in w.items()}, None, settings)
            for b, w in sorted(initial.items())
        }
        return cls(settings, blocks, probe=probe, seed=seed)

    @staticmethod
    def block(
        index: int,
        weights: Tensors,
        momentum: Tensors | None,
        settings: AggregatorSettings,
        rounds: BlockRounds | None = None,
        remainder: Tensors | None = None,
    ) -> EngineBlock:
        return EngineBlock(
            index,
            weights,
            momentum,
            BlockSpec.of(weights, settings.wire_dtype, settings.delta_wire),
            rounds if rounds is not None else BlockRounds(index, settings),
            accumulator(settings),
            remainder,
        )

    # ------------------------------------------------------------------ workers

    def register(
        self,
        now: float,
        requested: int | None,
        new_id: Callable[[int], int],
        token: int | None = None,
        allowed: Collection[int] | None = None,
        resume: int | None = None,
    ) -> Registered:
        """Assign a block (the requested one, else the fewest live identities among `allowed`);
        `new_id(block)` names the worker. A token at its `max_workers_per_token` has its oldest
        workers retired first, so that a restarted worker rejoins at once. `resume`: the id of a
        worker taken back, never retired for itself."""
        self.tick(now)
        replaced: list[int] = []
        if token is not None:
            mine = [w for w in self.registry.workers_of(token) if w != resume]
            replaced = mine[: max(0, len(mine) - self.settings.max_workers_per_token + 1)]
            for old in replaced:
                self.leave(old, now)
        done = [b for b, st in self.blocks.items() if st.rounds.done]
        block = self.registry.choose_block(now, requested, exclude=done, allowed=allowed)
        worker = new_id(block)
        self.registry.add(worker, block, now, token)
        st = self.blocks[block]
        st.rounds.assign(worker, now)
        return Registered(worker, block, st.rounds.view(), tuple(replaced))

    def leave(self, worker: int, now: float) -> list[Committed]:
        """The worker stops: its block no longer waits for it."""
        block = self.registry.block_of(worker)
        self.registry.remove(worker)
        self.pulled.pop(worker, None)
        self.pacer.forget(worker)
        if block is not None:
            self.blocks[block].rounds.unassign(worker)
        return self.tick(now)

    # ------------------------------------------------------------------ pulls and updates

    def pull(self, worker: int, block: int, now: float) -> PullEvent:
        """`worker` fetches the open round (nothing is recorded when the block is done)."""
        self.tick(now)
        rounds = self.blocks[block].rounds
        if rounds.done:
            return PullEvent(rounds.view(), False)
        started = rounds.started_at is None
        view = rounds.pull(worker, now)
        self.registry.seen(worker, now)
        self.pulled[worker] = (block, view.round, view.version)
        steps = self.pacer.pulled(worker, block, view.round, now, view.deadline)
        return PullEvent(view, started and view.deadline is not None, steps)

    def inspect(self, block: int, body: bytes | bytearray) -> Checked:
        """The form verdict on an update body; changes no state (callable outside a lock)."""
        if len(body) > self.max_body:
            detail = f"the body declares {len(body)} bytes; the limit is {self.max_body}"
            return Checked(Verdict.refuse("too_large", detail), None)
        try:
            decoded = decode(body, max_bytes=self.max_body)
        except WireError as exc:
            return Checked(Verdict.refuse(exc.reason, exc.detail), None)
        candidate = Candidate(block, decoded, self.blocks[block].spec, self.limits)
        verdict = validate(candidate)
        if verdict.accepted and candidate.norm != 0:
            candidate.sketch = self.sketcher.sketch(candidate.tensors)
        return Checked(verdict, candidate)

    def finish(self, checked: Checked, worker: int | None = None) -> Checked:
        """`worker`'s identity's standing, then the effect probe against the block's weights
        (an excluded identity's update is probed all the same). Changes no state, so the costly
        probe may run outside the driver's lock."""
        verdict, candidate = checked.verdict, checked.candidate
        if not verdict.accepted or candidate is None:
            return checked
        if worker is not None:
            standing = self.reputation.excluded(self.registry.identity(worker))
            verdict = verdict if standing.accepted else standing
        if self.probe is None:
            return Checked(verdict, candidate)
        block = candidate.block
        others = {b: st.weights for b, st in self.blocks.items() if b != block}
        effect = self.probe.effect(
            block, self.blocks[block].weights, candidate.tensors, others, self.settings.probe_step
        )
        judged = judge_effect(
            effect,
            self.settings.probe_tolerance,
            self.bands.get(block),
            self.settings.probe_z,
            self.settings.probe_gain_z,
        )
        return Checked(judged if verdict.accepted else verdict, candidate, effect, judged)

    def check(self, block: int, body: bytes | bytearray, worker: int | None = None) -> Checked:
        """`inspect`, then `finish`, for a caller that judges the timing itself."""
        return self.finish(self.inspect(block, body), worker)

    def judge(self, worker: int, block: int, meta: UpdateMeta, now: float) -> Verdict:
        """The timing verdict on an update (closing due rounds first); `record` it once the
        driver has stored it. An identity with `max_workers_per_token` updates in the open round
        is refused `duplicate`: a token that re-registers after each push still casts one vote a
        round (bench/live_attacks.py, push_flood: 102 pushes accepted in 30 s before)."""
        self.tick(now)
        assigned = self.registry.block_of(worker)
        if assigned != block:
            if assigned is None:
                return Verdict.refuse("unknown_worker", f"worker {worker} is not registered")
            return Verdict.refuse("not_assigned", f"worker {worker} trains block {assigned}")
        paced = self.pacer.check(worker, block, meta)
        if not paced.accepted:
            return paced
        rounds = self.blocks[block].rounds
        standing = self.drift.standing(block, self.registry.identity(worker), rounds.round)
        if not standing.accepted:
            return standing
        timing = rounds.judge(worker, round=meta.round, base_version=meta.base_version, now=now)
        if not timing.accepted:
            return timing
        return self.identity_full(worker, block) or timing

    def identity_full(self, worker: int, block: int) -> Verdict | None:
        """`duplicate` when `worker`'s identity already fills the block's open round (any
        further update would count there, so a driver may refuse it before reading its body)."""
        identity = self.registry.identity(worker)
        held = sum(e.identity == identity for e in self.blocks[block].acc.entries.values())
        if held < self.settings.max_workers_per_token:
            return None
        return Verdict.refuse(
            "duplicate",
            f"identity {identity} already has {held} update(s) in round "
            f"{self.blocks[block].rounds.round} of block {block}, as many as its token may run "
            "workers",
        )

    def record(
        self,
        worker: int,
        block: int,
        verdict: Verdict,
        now: float,
        *,
        checked: Checked,
        update_id: int = -1,
    ) -> bool:
        """Record a judged update in its round (an accepted one joins the accumulator); call
        `tick` afterwards. True when it started the open round's clock (counted late into a
        round nobody pulled yet)."""
        meta = checked.meta
        if meta is None:
            return False  # unreadable: it names no round
        identity = self.registry.identity(worker)
        probed, effect = checked.judged, checked.effect
        helpful = None if probed is None or effect is None else helped(probed, effect)
        if helpful is not None and self.reputation.observe(identity, helpful=helpful):
            for listener in self.on_reputation:
                listener(identity, self.reputation.of(identity), now)
        rounds = self.blocks[block].rounds
        self._remember(block, checked, identity, verdict)
        self.pacer.observe(worker, block, meta, verdict, now)
        if not verdict.accepted:
            rounds.record(worker, verdict, round=meta.round, now=now)
            return False
        candidate = checked.candidate
        assert candidate is not None and candidate.tensors is not None
        if checked.effect is not None:
            self.bands[block] = self.bands.get(block, HonestBand()).add(checked.effect.relative)
        if update_id < 0:
            self._auto_id -= 1
            update_id = self._auto_id
        idle = rounds.started_at is None
        rounds.record(
            worker, verdict, round=meta.round, now=now, update_id=update_id, tokens=meta.tokens
        )
        self.blocks[block].acc.add(
            update_id,
            candidate.tensors,
            identity=identity,
            weight=verdict.weight * self.reputation.of(identity) * self.pacer.share(meta),
            tokens=meta.tokens,
            effect=None if checked.effect is None else checked.effect.relative,
        )
        self.registry.seen(worker, now)
        return idle and rounds.started_at is not None

    def discard(self, block: int, update_ids: Iterable[int]) -> list[int]:
        """Take accepted updates (of a revoked or banned token) back out of the open round;
        returns the ids removed."""
        st = self.blocks[block]
        removed = st.acc.discard(update_ids)
        gone = set(removed)
        st.rounds.accepted = [c for c in st.rounds.accepted if c.update_id not in gone]
        return removed

    # ------------------------------------------------------------------ rounds

    def penalise(self, drifted: Iterable[Drifted], now: float) -> None:
        """Each identity the drift tracker flagged loses reputation as for a harmful update."""
        for flagged in drifted:
            identity = cast(tuple[str, int], flagged.identity)  # `Registry.identity`'s
            if self.reputation.observe(identity, helpful=False):
                for tell in self.on_reputation:
                    tell(identity, self.reputation.of(identity), now)

    def tick(self, now: float) -> list[Committed]:
        """Close and commit every round that is due."""
        committed = []
        for st in self.blocks.values():
            closed = None if st.index in self.observing else st.rounds.tick(now)
            if closed is not None:
                committed.append(self._commit(st, closed))
        return committed

    def _commit(self, st: EngineBlock, closed: RoundClosed) -> Committed:
        """Aggregate the round under the influence bound; observe its votes' drift (`penalise`:
        its vote of this round still counts)."""
        drifted: tuple[Drifted, ...] = ()
        if self.drift.on and st.acc.count:
            identities, votes, _ = st.acc.by_identity()
            observe = partial(
                self.drift.observe, st.index, closed.round, identities, votes, st.acc.effects()
            )
            if self.drift_later is not None:
                self.observing.add(st.index)
                self.drift_later(closed, observe)
            else:
                drifted = tuple(observe())
                self.penalise(drifted, closed.closed_at)
        aggregate = st.acc.result(st.influence.reference())
        weights, momentum, remainder = st.weights, st.momentum, st.remainder
        if aggregate.delta is not None:
            weights, momentum = self.outer.apply(st.weights, aggregate.delta, st.momentum)
        if aggregate.uncapped is not None:
            st.influence = st.influence.add(aggregate.uncapped)
        changed = closed.new_version != closed.base_version
        step = None
        codec = self.settings.commit_codec
        if changed and codec is not None:  # exact pulls: the version as the pull codec carries it
            made = commit_step(st.weights, weights, st.remainder, codec)
            weights, remainder, step = made.weights, made.remainder, made.parts
        event = Committed(
            closed, weights, momentum, changed, aggregate.held, remainder, step, drifted
        )
        for listener in self.on_commit:
            listener(event)
        st.weights, st.momentum, st.remainder = weights, momentum, remainder
        st.acc = accumulator(self.settings)
        keep = st.rounds.round - self.settings.replay_rounds
        self.seen[st.index] = self.seen.get(st.index, SeenBodies()).since(keep)
        return event
