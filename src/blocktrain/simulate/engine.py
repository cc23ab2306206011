"""The event loop: N virtual workers against one `SimAggregator`, on a virtual clock.

Nothing sleeps: events wait in a heap ordered by (virtual time, insertion order), so a run is a
pure function of its seed. A worker's life (ready, pull, pulled, push, pushed) mirrors
`protocol.worker.loop.WorkerLoop`; docs/simulate.md, "A worker's life in virtual time".
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from blocktrain.protocol.core.bodies import update_body
from blocktrain.protocol.core.bounds import largest_block
from blocktrain.protocol.core.codecs import DeltaEncoder
from blocktrain.protocol.core.delta_wire import pull_codec
from blocktrain.protocol.core.effect import EffectProbe
from blocktrain.protocol.core.events import Committed
from blocktrain.protocol.core.local_trainer import LocalTrainer, RelayTrainer
from blocktrain.protocol.core.participation import in_time, participation
from blocktrain.protocol.core.relays import RelayPool, keeps_stream
from blocktrain.protocol.core.rounds import RoundClosed
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.relaystream import Shape
from blocktrain.simulate.aggregator import Judged, SimAggregator
from blocktrain.simulate.attacks import Hostiles
from blocktrain.simulate.regimes import Regime
from blocktrain.simulate.workers import Tensors, VirtualWorker
from blocktrain.training.costs import WorkerCost, wire_bytes
from blocktrain.training.profiles import DeviceProfile

Evaluator = Callable[[dict[int, Tensors]], float]  # assembled per-block weights -> CE


class Simulation:
    """One regime, start to finish."""

    def __init__(
        self,
        regime: Regime,
        settings: AggregatorSettings,
        initial: dict[int, Tensors],
        make_trainer: Callable[[int, int], LocalTrainer],
        n_workers: int,
        *,
        seed: int,
        costs: Mapping[int, WorkerCost],
        profile: DeviceProfile,
        evaluate: Evaluator | None = None,
        eval_every: int = 1,
        on_round: Callable[[int, int], None] | None = None,
        probe: EffectProbe | None = None,
        hostiles: Hostiles | None = None,
        slowdown: Mapping[int, float] | None = None,
        relay: Shape | None = None,
    ) -> None:
        """`n_workers` honest workers (ids 0..n-1, as in a clean run), then the attackers of
        `hostiles`; `slowdown`: honest worker id -> a factor on the speed it drew; `relay`:
        under `route = relay`, a stream step's shape (a `RelayPool` per block)."""
        if settings.max_rounds is None:
            raise ValueError("a simulation needs settings.max_rounds")
        if sorted(costs) != sorted(initial):
            raise ValueError(f"costs for units {sorted(costs)}, not {sorted(initial)}")
        self.regime = regime
        self.costs = dict(costs)
        self.profile = profile
        self.rng = random.Random(f"blocktrain-simulate:{seed}:{regime.name}")
        self._dtype_bytes = wire_bytes(settings.wire_dtype)
        # the slowest block's nominal round, so that every block can make the deadline
        self.nominal_round_s = max(
            c.round_s(profile, compute_factor=regime.speed.typical) for c in costs.values()
        )
        self.deadline_s = regime.deadline_for(self.nominal_round_s)
        self.settings = settings.replace(deadline_s=self.deadline_s)
        self.agg = SimAggregator(initial, self.settings, probe, seed)
        self.agg.on_close.append(self._closed)
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.on_round = on_round
        self.rounds = settings.max_rounds
        self.train_s = self.eval_s = self.wall_s = 0.0  # where the wall time went
        self._heap: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self._waiting: dict[int, list[VirtualWorker]] = {b: [] for b in initial}
        self._deadline_ticks: set[tuple[int, int]] = set()
        self.closed: dict[tuple[int, int], RoundClosed] = {}
        self.refusals: dict[tuple[int, int], Counter[str]] = {}
        self._snapshots: dict[int, dict[int, Tensors]] = {}
        self.ce: dict[int, float] = {}
        self.bytes_down = self.bytes_up = self.stream_bytes_down = self.stream_bytes_up = 0
        self.relays = {} if relay is None else {b: RelayPool(b, relay) for b in initial}
        # block -> the workers waiting for a stream of that block
        self._relay_waiting: dict[int, list[VirtualWorker]] = {b: [] for b in initial}
        self.workers: list[VirtualWorker] = []
        slow = dict(slowdown or {})
        self.hostiles = hostiles
        for _ in range(n_workers):
            worker_id, block = self.agg.register(0.0)
            trainer = make_trainer(worker_id, block)
            if hostiles is not None:
                trainer = hostiles.watch(worker_id, block, trainer)
            self._add(worker_id, block, trainer, slow.get(worker_id, 1.0))
        for i in range(0 if hostiles is None else hostiles.attack.count):
            assert hostiles is not None
            attack = hostiles.attack
            worker_id, block = self.agg.register(0.0, attack.block, attack.token(i))
            self._add(worker_id, block, hostiles.trainer(i, worker_id, block), attacker=True)
        self.held: dict[tuple[int, int], str] = {}
        self._by_id = {w.id: w for w in self.workers}
        self._wire_bytes = largest_block(initial) * self._dtype_bytes

    def _add(
        self,
        worker_id: int,
        block: int,
        trainer: LocalTrainer,
        slowdown: float = 1.0,
        attacker: bool = False,
    ) -> None:
        speed = self.regime.speed.draw(self.rng) * slowdown
        link = self.regime.bandwidth_MBps.factor(self.rng)
        self.workers.append(
            VirtualWorker(
                worker_id,
                block,
                trainer,
                DeltaEncoder(self.settings.push_wire),
                speed=speed,
                down=self.profile.link_down_bytes_per_s * link,
                up=self.profile.link_up_bytes_per_s * link,
                attacker=attacker,
            )
        )

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        started = time.perf_counter()
        for w in self.workers:
            self._ready(w, 0.0)
        while self._heap:
            now, _, kind, key = heapq.heappop(self._heap)
            if kind == "tick":
                self.agg.tick(now)
                continue
            w = self._by_id[key]
            getattr(self, f"_on_{kind}")(w, now)
        self.wall_s = time.perf_counter() - started

    def _at(self, when: float, kind: str, key: int) -> None:
        heapq.heappush(self._heap, (when, self._seq, kind, key))
        self._seq += 1

    def _latency(self) -> float:
        return self.profile.latency_s * self.regime.latency_s.factor(self.rng)

    def _ready(self, w: VirtualWorker, now: float) -> None:
        self._at(now + self._latency(), "pull", w.id)

    def _on_pull(self, w: VirtualWorker, now: float) -> None:
        rounds = self.agg.blocks[w.block].rounds
        if not rounds.done and rounds.round <= w.last_round:
            self._waiting[w.block].append(w)  # long poll until the round closes
            return
        source = _relays_from(w.trainer)
        stream_bytes = 0
        if source is not None and not rounds.done:
            # a stream it has not trained on (once the block before is done: the newest again)
            relayed = self.relays[source].take(w.id, reuse=self.agg.blocks[source].rounds.done)
            if relayed is None:
                self._relay_waiting[source].append(w)  # a long poll for the next stream
                return
            w.stream = relayed.stream()
            stream_bytes = len(relayed.body)
            self.stream_bytes_down += stream_bytes
        view, weights, delta_bytes, w.told = self.agg.pull(w.id, w.block, now, w.held)
        if weights is None:
            w.stopped = True
            return
        if view.deadline is not None and (w.block, view.round) not in self._deadline_ticks:
            self._deadline_ticks.add((w.block, view.round))
            self._at(view.deadline, "tick", w.block)
            # and when the minimum round length passes (an early close may wait for it)
            self._at(view.deadline - self.deadline_s + self.settings.min_round, "tick", w.block)
        w.holding = view
        w.held = weights
        nbytes = self._wire_bytes if delta_bytes is None else delta_bytes
        # route = features: the blocks it reads, as deltas from its views with a pull codec (an
        # HTTP worker's `latest`), else whole (commits build new dicts: these stay as pulled)
        if pull_codec(self.settings.pulls) is None:
            w.upstream = {b: self.agg.blocks[b].weights for b in w.trainer.upstream_blocks}
            nbytes += sum(
                self._dtype_bytes * v.numel() for t in w.upstream.values() for v in t.values()
            )
        else:
            w.upstream = {}
            for b in w.trainer.upstream_blocks:
                w.upstream_views[b], sent = self.agg.latest(b, w.upstream_views.get(b))
                w.upstream[b] = w.upstream_views[b].tensors
                nbytes += sent
        nbytes += stream_bytes  # relay: the round's stream, as it was relayed
        self.bytes_down += nbytes
        self._at(now + self._latency() + nbytes / w.down, "pulled", w.id)

    def _on_pulled(self, w: VirtualWorker, now: float) -> None:
        assert w.holding is not None and w.held is not None
        view, weights = w.holding, w.held.tensors
        w.holding = None
        if self.rng.random() < self.regime.dropout:
            w.dropped += 1
            w.last_round = view.round
            self._ready(w, max(now, view.deadline if view.deadline is not None else now))
            return
        h, told = self.settings.local_steps, w.told
        step_s = self.costs[w.block].step_s(self.profile) * self.regime.step_s.factor(self.rng)
        w.trainer.load(weights)
        w.trainer.load_upstream(w.upstream)
        if w.stream is not None:
            assert isinstance(w.trainer, RelayTrainer)
            w.trainer.load_stream(w.stream)
            w.stream = None
        t0 = time.perf_counter()
        # as a WorkerLoop: from step version x H; never stopped mid-round (dropouts are drawn)
        logs = w.trainer.train(told, view.version * h, lambda: False)
        if isinstance(w.trainer, RelayTrainer) and w.trainer.relays_to is not None:
            out = w.trainer.stream_out({"round": str(view.round), "worker": str(w.id)})
            w.stream_out = None if out is None else out.read()
        self.train_s += time.perf_counter() - t0
        w.local_steps += int(logs["steps"])
        if w.attacker:
            w.reported = {k: v for k, v in logs.items() if k not in ("tokens", "loss", "steps")}
        loss = float(logs["loss"])
        body = update_body(
            w.block,
            w.encoder.compress(w.trainer.delta()),
            base_version=view.version,
            round=view.round,
            tokens=int(logs["tokens"]),
            loss=loss if math.isfinite(loss) else None,
            worker_id=w.id,
            steps=told,  # as the pull told it (a forger claims the most it may)
        )
        w.body = (view.round, body)
        compute = told * step_s * w.speed
        w.sent = len(body) + (0 if w.stream_out is None else len(w.stream_out))
        self._at(now + compute + self._latency() + w.sent / w.up, "push", w.id)

    def _on_push(self, w: VirtualWorker, now: float) -> None:
        assert w.body is not None
        trained_on, body = w.body
        w.body = None
        self.bytes_up += w.sent
        judged = self.agg.push(w.id, w.block, body, now)
        self._account(w, judged)
        if w.stream_out is not None:  # after the delta, as a WorkerLoop sends it
            self.stream_bytes_up += len(w.stream_out)
            if keeps_stream(judged.verdict):
                self.relays[w.block].put(trained_on, w.id, w.stream_out)
                self._wake_relay(w.block, now)
            w.stream_out = None
        if w.attacker:
            fate = "accepted" if judged.verdict.accepted else judged.verdict.reason
            w.pushes.append({"round": trained_on, "fate": fate, **w.reported})
        w.last_round = trained_on
        self._at(now + self._latency(), "pushed", w.id)

    _on_pushed = _ready  # ready again

    def _wake_relay(self, block: int, now: float) -> None:
        """The long polls for a stream of `block` answer (a new one, or the block is done)."""
        waiting, self._relay_waiting[block] = self._relay_waiting[block], []
        for w in waiting:
            self._at(now + self._latency(), "pull", w.id)

    # ------------------------------------------------------------------ records

    def _account(self, w: VirtualWorker, judged: Judged) -> None:
        if self.hostiles is not None:
            self.hostiles.judged(judged)
        if judged.verdict.accepted:
            w.accepted += 1
            return
        w.refused[judged.verdict.reason] += 1
        w.encoder.reset()  # as a WorkerLoop does after a refusal
        if judged.round is not None:
            key = (judged.block, judged.round)
            self.refusals.setdefault(key, Counter())[judged.verdict.reason] += 1

    def _closed(self, event: Committed) -> None:
        closed, weights = event.closed, event.weights
        b, r = closed.block, closed.round
        self.closed[(b, r)] = closed
        if event.held:
            self.held[(b, r)] = event.held
        waiting, self._waiting[b] = self._waiting[b], []
        for w in waiting:  # the long poll answers; the pull follows
            self._at(closed.closed_at + self._latency() + self._latency(), "pull", w.id)
        if self.agg.blocks[b].rounds.done:  # who waits for its streams takes the newest again
            self._wake_relay(b, closed.closed_at)
        if self.on_round is not None:
            self.on_round(b, r)
        if self.evaluate is None or not self._evaluated(r):
            return
        snapshot = self._snapshots.setdefault(r, {})
        snapshot[b] = {k: v.clone() for k, v in weights.items()}
        if len(snapshot) == len(self.agg.blocks):
            del self._snapshots[r]
            t0 = time.perf_counter()
            self.ce[r] = self.evaluate(snapshot)
            self.eval_s += time.perf_counter() - t0

    def _evaluated(self, r: int) -> bool:
        return (r + 1) % self.eval_every == 0 or r == self.rounds - 1

    def records(self) -> list[dict[str, Any]]:
        """One record per round index: each block's close, and the model's CE after it."""
        blocks = sorted(self.agg.blocks)
        out = []
        for r in range(self.rounds):
            closes = [self.closed.get((b, r)) for b in blocks]
            if any(c is None for c in closes):
                break
            done = [c for c in closes if c is not None]
            own = [in_time(d) for d in done]
            expected = [len(d.expected) for d in done]
            out.append(
                {
                    "round": r,
                    "time": max(d.closed_at for d in done),
                    "participation": participation(sum(own), sum(expected)),
                    "from_noise_ce": self.ce.get(r),
                    "blocks": [
                        {
                            "block": d.block,
                            "closed_at": d.closed_at,
                            "cause": d.cause,
                            "version": d.new_version,
                            "accepted": len(d.accepted),
                            "accepted_late": len(d.accepted) - n_own,
                            "refused": dict(sorted(self.refusals.get((d.block, r), {}).items())),
                            "expected": len(d.expected),
                            "reported": len(d.reported),
                            "participation": participation(n_own, len(d.expected)),
                            "held": self.held.get((d.block, r), ""),
                        }
                        for d, n_own in zip(done, own, strict=True)
                    ],
                }
            )
        return out

    def summary(self) -> dict[str, Any]:
        records = self.records()
        own = sum(in_time(d) for d in self.closed.values())
        expected = sum(len(d.expected) for d in self.closed.values())
        refused: Counter[str] = Counter()
        for w in self.workers:
            refused.update(w.refused)
        return {
            "participation": participation(own, expected),
            "rounds": records,
            "virtual_time_s": records[-1]["time"] if records else 0.0,
            "deadline_s": self.deadline_s,
            "nominal_round_s": self.nominal_round_s,
            "updates": {
                "accepted": sum(w.accepted for w in self.workers),
                "refused": dict(sorted(refused.items())),
                "dropped": sum(w.dropped for w in self.workers),
                "expected": expected,
                "in_time": own,
            },
            "bytes": {
                "down": self.bytes_down,
                "up": self.bytes_up,
                "stream_down": self.stream_bytes_down,
                "stream_up": self.stream_bytes_up,
            },
            "workers": [w.record() for w in self.workers],
            "compute": {
                "wall_s": self.wall_s,
                "train_s": self.train_s,
                "eval_s": self.eval_s,
                "other_s": max(0.0, self.wall_s - self.train_s - self.eval_s),
                "train_fraction": self.train_s / self.wall_s if self.wall_s > 0 else 0.0,
            },
        }


def _relays_from(trainer: LocalTrainer) -> int | None:
    return trainer.relays_from if isinstance(trainer, RelayTrainer) else None
