"""Echoes of honest work (`copy`, `replay`): an attacker that trains nothing and pushes, under its
own token, a delta an honest worker of its block made, handed to it by the simulator (`Witness`;
over the network: a worker sharing a host, link or bucket with an honest one). What they meet is
the replay screen (`protocol.core.replays`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blocktrain.protocol.core.local_trainer import LocalTrainer, RelayTrainer
from blocktrain.relaystream import RelayStream, StreamBody
from blocktrain.simulate.aggregator import Judged
from blocktrain.simulate.attacks.forge import Tensors

KEEP = 4  # accepted honest pushes a witness keeps per block (a replay needs the newest earlier)


@dataclass(frozen=True)
class Push:
    """An honest worker's update as its trainer made it: the run step it trained from
    (version x H), its logs (tokens and loss claimed) and its delta."""

    first_step: int
    logs: dict[str, float]
    delta: Tensors


class Witness:
    """What the attackers of a simulation see of the honest workers: each one's pushes, and the
    verdicts on them. A worker trains, pushes and hears its verdict before it trains again, so
    a verdict is on that worker's latest push."""

    def __init__(self) -> None:
        self.latest: dict[int, tuple[int, Push]] = {}  # honest worker -> (block, latest push)
        self.newest: dict[int, Push] = {}  # block -> first honest push of the newest step seen
        self.accepted: dict[int, list[Push]] = {}  # block -> its latest KEEP accepted, in order

    def saw(self, worker: int, block: int, push: Push) -> None:
        self.latest[worker] = (block, push)
        seen = self.newest.get(block)
        if seen is None or seen.first_step < push.first_step:
            self.newest[block] = push

    def judged(self, judged: Judged) -> None:
        """Note a verdict (an attacker's, unwatched, is ignored)."""
        if judged.verdict.accepted and judged.worker in self.latest:
            block, push = self.latest[judged.worker]
            kept = self.accepted.setdefault(block, [])
            kept.append(push)
            del kept[:-KEEP]

    def copy_of(self, block: int) -> Push | None:
        return self.newest.get(block)

    def replay_of(self, block: int, first_step: int) -> Push | None:
        earlier = [p for p in self.accepted.get(block, []) if p.first_step < first_step]
        return earlier[-1] if earlier else None


class Watched:
    """An honest worker's trainer, unchanged, that shows the `Witness` each push it makes."""

    def __init__(self, trainer: LocalTrainer, witness: Witness, worker: int, block: int) -> None:
        self.trainer = trainer
        self.witness = witness
        self.worker = worker
        self.block = block
        self.upstream_blocks = trainer.upstream_blocks
        self._trained: tuple[int, dict[str, float]] = (0, {})
        if isinstance(trainer, RelayTrainer):  # route = relay: it takes and relays as before
            self.relays_from, self.relays_to = trainer.relays_from, trainer.relays_to
            self.load_stream, self.stream_out = trainer.load_stream, trainer.stream_out

    def load(self, weights: Tensors) -> None:
        self.trainer.load(weights)

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        self.trainer.load_upstream(blocks)

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        logs = self.trainer.train(steps, first_step, should_stop)
        self._trained = (first_step, logs)
        return logs

    def delta(self) -> Tensors:
        delta = self.trainer.delta()
        self.witness.saw(self.worker, self.block, Push(*self._trained, delta))
        return delta


class EchoTrainer:
    """A `LocalTrainer` that pushes a witnessed honest delta (`copy`, `replay`) with that
    push's claims. In lockstep a copy is of the same run step (honest workers act first at
    equal virtual times); elsewhere it is of the newest one seen. With nothing to echo yet it
    pushes zeros, claiming one token."""

    def __init__(
        self,
        kind: str,
        witness: Witness,
        block: int,
        upstream: list[int],
        relays_from: int | None = None,
    ) -> None:
        self.kind = kind
        self.witness = witness
        self.block = block
        # it pulls what an honest replica of its block pulls (its upstream blocks; under relay
        # a stream), and ignores it: the same bytes and waits, so that it arrives with the
        # honest replicas (and, in lockstep, just after them)
        self.upstream_blocks = upstream
        self.relays_from = relays_from
        self.relays_to: int | None = None  # it relays nothing
        self.zeros: Tensors = {}
        self.echo: Push | None = None

    def load(self, weights: Tensors) -> None:
        self.zeros = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in weights.items()}

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        pass

    def load_stream(self, stream: RelayStream) -> None:
        pass

    def stream_out(self, metadata: dict[str, str]) -> StreamBody | None:
        return None

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        if self.kind == "copy":
            self.echo = self.witness.copy_of(self.block)
        else:
            self.echo = self.witness.replay_of(self.block, first_step)
        if self.echo is None:
            return {"tokens": 1.0, "loss": math.nan, "steps": 0.0}
        return {**self.echo.logs, "steps": 0.0}

    def delta(self) -> Tensors:
        return self.zeros if self.echo is None else dict(self.echo.delta)
