"""The aggregator's decisions in memory: no HTTP, SQLite, disk or wall clock.

Every decision is taken by the code `protocol.service.AggregatorService` calls, in the same
order: `Registry.choose_block` assigns, `wire.decode` and `validation.validate` check an update's
content, `BlockRounds.judge` / `record` / `tick` its timing and the round's close, the
`Accumulator` averages and the `OuterOptimizer` applies. What the service adds around them
(tokens, the ledger, durable bodies, byte counters) does not change a decision, and is left out.
`tests/simulate/test_trace.py` drives this class and the real service with one trace and checks
that every verdict, every close and every weight agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blocktrain.protocol.aggregation import Accumulator, OuterOptimizer
from blocktrain.protocol.rounds import BlockRounds, Registry, RoundClosed, RoundPolicy, RoundView
from blocktrain.protocol.settings import AggregatorSettings
from blocktrain.protocol.validation import BlockSpec, Candidate, Limits, validate
from blocktrain.protocol.verdict import Verdict
from blocktrain.protocol.wire import WireError, decode, wire_dtype

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Judged:
    """One push and its fate."""

    worker: int
    block: int
    round: int | None
    """The round the update names (None when its metadata could not be read)."""
    verdict: Verdict
    tokens: int = 0
    nbytes: int = 0


@dataclass
class SimBlock:
    index: int
    weights: Tensors
    momentum: Tensors | None
    spec: BlockSpec
    rounds: BlockRounds
    acc: Accumulator
    published: tuple[int, Tensors] | None = None
    """(version, weights in the wire dtype) of the last pull."""


class SimAggregator:
    """Blocks, their round state machines and accumulators, fed with explicit virtual times."""

    def __init__(self, initial: dict[int, Tensors], settings: AggregatorSettings) -> None:
        self.settings = settings
        policy = RoundPolicy(
            settings.deadline_s, settings.staleness, settings.stale_weight, settings.max_rounds
        )
        self.blocks: dict[int, SimBlock] = {}
        for b, tensors in sorted(initial.items()):
            weights = {k: v.detach().float().clone() for k, v in tensors.items()}
            self.blocks[b] = SimBlock(
                b,
                weights,
                None,
                BlockSpec.of(weights, settings.wire_dtype),
                BlockRounds(b, policy),
                Accumulator(settings.rule, settings.trim),
            )
        self.registry = Registry(len(initial), settings.live_window)
        self.outer = OuterOptimizer(settings.outer_lr, settings.outer_momentum)
        self.limits = Limits(settings.max_delta_norm, settings.max_tokens)
        largest = max(st.spec.n_params for st in self.blocks.values())
        self.max_body = settings.max_body_bytes or 2 * 4 * largest + (1 << 20)
        self.on_close: list[Callable[[RoundClosed, Tensors], None]] = []
        """Called after each commit with the round and the block's new weights."""
        self._next_worker = 0  # ids as the ledger gives them: 0, 1, 2, ...

    # ------------------------------------------------------------------ workers

    def register(self, now: float, block: int | None = None) -> tuple[int, int]:
        """(worker id, block), as `AggregatorService.register` assigns them."""
        self.tick(now)
        done = [b for b, st in self.blocks.items() if st.rounds.done]
        chosen = self.registry.choose_block(now, block, exclude=done)
        worker = self._next_worker
        self._next_worker += 1
        self.registry.add(worker, chosen, now)
        self.blocks[chosen].rounds.assign(worker)
        return worker, chosen

    def leave(self, worker: int, now: float) -> None:
        block = self.registry.block_of(worker)
        self.registry.remove(worker)
        if block is not None:
            self.blocks[block].rounds.unassign(worker)
        self.tick(now)

    # ------------------------------------------------------------------ pulls and pushes

    def pull(self, worker: int, block: int, now: float) -> tuple[RoundView, Tensors | None]:
        """The open round and its weights as they travel (the wire dtype); no weights when the
        block is done."""
        self.tick(now)
        st = self.blocks[block]
        if st.rounds.done:
            return st.rounds.view(), None
        view = st.rounds.pull(worker, now)
        self.registry.seen(worker, now)
        if st.published is None or st.published[0] != view.version:
            dtype = wire_dtype(self.settings.wire_dtype)
            st.published = (view.version, {k: v.to(dtype) for k, v in st.weights.items()})
        return view, st.published[1]

    def push(self, worker: int, block: int, body: bytes, now: float) -> Judged:
        """Validate, judge and (if accepted) accumulate one update body."""
        st = self.blocks[block]
        if len(body) > self.max_body:
            verdict = Verdict.refuse(
                "too_large", f"the body declares {len(body)} bytes; the limit is {self.max_body}"
            )
            return Judged(worker, block, None, verdict, nbytes=len(body))
        try:
            decoded = decode(body, max_bytes=self.max_body)
        except WireError as exc:
            return Judged(worker, block, None, Verdict.refuse(exc.reason, exc.detail), 0, len(body))
        candidate = Candidate(block, decoded, st.spec, self.limits)
        verdict = validate(candidate)
        meta = candidate.meta
        if not verdict.accepted:
            if meta is not None:
                st.rounds.record(worker, verdict, round=meta.round, now=now)
            self.tick(now)
            return Judged(
                worker, block, None if meta is None else meta.round, verdict, 0, len(body)
            )
        assert meta is not None
        self.tick(now)
        verdict = st.rounds.judge(worker, round=meta.round, base_version=meta.base_version, now=now)
        if verdict.accepted:
            st.rounds.record(
                worker, verdict, round=meta.round, now=now, update_id=-1, tokens=meta.tokens
            )
            st.acc.add(candidate.tensors, verdict.weight * meta.tokens)
            self.registry.seen(worker, now)
        else:
            st.rounds.record(worker, verdict, round=meta.round, now=now)
        self.tick(now)
        return Judged(worker, block, meta.round, verdict, meta.tokens, len(body))

    # ------------------------------------------------------------------ rounds

    def tick(self, now: float) -> list[RoundClosed]:
        closed = []
        for st in self.blocks.values():
            result = st.rounds.tick(now)
            if result is not None:
                self._commit(st, result)
                closed.append(result)
        return closed

    def _commit(self, st: SimBlock, closed: RoundClosed) -> None:
        delta = st.acc.result()
        if delta is not None:
            st.weights, st.momentum = self.outer.apply(st.weights, delta, st.momentum)
        st.acc = Accumulator(self.settings.rule, self.settings.trim)
        for listener in self.on_close:
            listener(closed, st.weights)

    def weights(self, block: int) -> Tensors:
        return self.blocks[block].weights
