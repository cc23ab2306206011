"""The simulator's aggregator: the protocol's own `RoundEngine` on the virtual clock, with no
tokens, ledger or disk. Every decision is the engine's, as `AggregatorService` takes it; this
class keeps only what the virtual workers need around it (worker ids, the weights in transit)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blocktrain.protocol.core.bodies import wire_dtype
from blocktrain.protocol.core.delta_wire import pull_codec
from blocktrain.protocol.core.effect import EffectProbe
from blocktrain.protocol.core.events import Committed, EngineBlock
from blocktrain.protocol.core.pulls import (
    Commits,
    View,
    Views,
    read_commit,
    read_delta,
    whole_view,
)
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.rounds import RoundView
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import Verdict

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Judged:
    """One push and its fate."""

    worker: int
    block: int
    round: int | None  # the round the update names (None: its metadata could not be read)
    verdict: Verdict


class SimAggregator:
    """A `RoundEngine` fed with explicit virtual times."""

    def __init__(
        self,
        initial: dict[int, Tensors],
        settings: AggregatorSettings,
        probe: EffectProbe | None = None,
        seed: int = 0,
    ) -> None:
        """`seed`: the secret of the engine's sketches (the service draws it secretly)."""
        self.settings = settings
        self.engine = RoundEngine.fresh(initial, settings, probe, seed=seed)
        self.blocks: dict[int, EngineBlock] = self.engine.blocks
        self.on_close: list[Callable[[Committed], None]] = self.engine.on_commit
        # block -> the last version pulled whole, in the wire dtype (fp32 under exact pulls)
        self._published: dict[int, View] = {}
        # what an HTTP aggregator's `Versions.views` holds (compressed pulls, not exact), and
        # under exact pulls its `Versions.commits`
        self.views = Views(settings.wire_dtype)
        codec = settings.commit_codec
        self.commits = None if codec is None else Commits(codec)
        self.on_close.append(self._remember_step)
        self._next_worker = 0  # ids as the ledger gives them: 0, 1, 2, ...

    def _new_id(self, _block: int) -> int:
        self._next_worker += 1
        return self._next_worker - 1

    def register(
        self, now: float, block: int | None = None, token: int | None = None
    ) -> tuple[int, int]:
        """(worker id, block); `token`: the identity the worker speaks for (default: itself)."""
        reg = self.engine.register(now, block, self._new_id, token)
        return reg.worker, reg.block

    def pull(
        self, worker: int, block: int, now: float, held: View | None = None
    ) -> tuple[RoundView, View | None, int | None, int]:
        """The open round, the weights the worker then holds (none when the block is done), the
        bytes of a delta pull (`_send`) and the local steps the pull tells (`core.pacing`)."""
        pulled = self.engine.pull(worker, block, now)
        view = pulled.view
        steps = self.settings.local_steps if pulled.local_steps is None else pulled.local_steps
        if view.done:
            return view, None, None, steps
        weights, delta_bytes = self._send(block, view.version, held)
        return view, weights, delta_bytes, steps

    def latest(self, block: int, held: View | None) -> tuple[View, int]:
        """What a `route = features` worker reads of a block before its own: the latest
        committed version (no pull recorded), as the HTTP client's `latest`; and its bytes."""
        weights, delta_bytes = self._send(block, self.blocks[block].rounds.version, held)
        if delta_bytes is not None:
            return weights, delta_bytes
        size = torch.empty((), dtype=wire_dtype(self.settings.wire_dtype)).element_size()
        return weights, sum(v.numel() * size for v in weights.tensors.values())

    def _send(self, block: int, version: int, held: View | None) -> tuple[View, int | None]:
        """Version `version` of `block` as a worker then holds it (the wire dtype), and the
        bytes of a delta pull (`protocol.core.pulls`: with a pull codec and a view `held`,
        exactly what an HTTP worker would get and compute; None for a whole one)."""
        weights = self.blocks[block].weights
        codec = pull_codec(self.settings.pulls)
        if codec is not None and held is not None and held.block == block:
            if held.version == version:
                return held, 0
            if self.commits is None:
                sent = self.views.delta(block, version, weights, held.id, codec)
                return read_delta(sent.body, held, version, codec), len(sent.body)
            walked = self._walk(self.commits, block, version, held)
            if walked is not None:
                return walked
        published = self._published.get(block)
        if published is None or published.version != version:
            if self.commits is None:
                published = self.views.whole(block, version, weights)
            else:
                published = whole_view(block, version, weights, self.settings.wire_dtype, True)
            self._published[block] = published
        return published, None

    @staticmethod
    def _walk(commits: Commits, block: int, version: int, held: View) -> tuple[View, int] | None:
        """Exact pulls: the commits from `held` to `version` in turn, as an HTTP worker walks
        them, and their bytes; None when one is not held (the worker then pulls whole)."""
        if not commits.holds(block, held.version + 1, version):
            return None
        view, nbytes = held, 0
        for v in range(held.version + 1, version + 1):
            body = commits.get(block, v).body
            view, nbytes = read_commit(body, view, v, commits.codec), nbytes + len(body)
        return view, nbytes

    def _remember_step(self, event: Committed) -> None:
        if self.commits is not None and event.step is not None:
            self.commits.add(event.closed.block, event.closed.new_version, event.step)

    def push(self, worker: int, block: int, body: bytes, now: float) -> Judged:
        """Check, judge and record one update body, in the service's order: form, timing,
        replays, a place at the probe, then its effect (and its identity's standing)."""
        checked = self.engine.inspect(block, body)
        meta = checked.meta
        verdict = checked.verdict
        if verdict.accepted:
            assert meta is not None
            timing = verdict = self.engine.judge(worker, block, meta, now)
            if verdict.accepted:
                verdict = self.engine.screen(worker, block, checked)
            if verdict.accepted:
                verdict, slot = self.engine.reserve_probe(worker, block)
                if verdict.accepted:
                    checked = self.engine.finish(checked, worker)
                    verdict = timing if checked.verdict.accepted else checked.verdict
                    self.engine.release_probe(slot, accepted=verdict.accepted)
        self.engine.record(worker, block, verdict, now, checked=checked)
        self.engine.tick(now)
        return Judged(worker, block, None if meta is None else meta.round, verdict)

    def tick(self, now: float) -> list[Committed]:
        return self.engine.tick(now)
