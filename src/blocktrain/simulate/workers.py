"""What the event loop keeps per virtual worker, and `TimingOnlyTrainer` (`--timing-only`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from blocktrain.protocol.core.codecs import DeltaEncoder
from blocktrain.protocol.core.local_trainer import LocalTrainer
from blocktrain.protocol.core.pulls import View
from blocktrain.protocol.core.rounds import RoundView
from blocktrain.relaystream import RelayStream, Shape, StreamBody, StreamWriter, relayed_steps

Tensors = dict[str, torch.Tensor]


class TimingOnlyTrainer:
    """No compute: zero deltas with honest token counts, for timing and participation studies."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        tokens_per_step: int,
        upstream_blocks: list[int] | None = None,
        *,
        block: int = 0,
        relay: Shape | None = None,
        blocks: int = 1,
        relay_every: int = 1,
    ) -> None:
        """It pulls what a real worker pulls (`upstream_blocks`) and, under relay, takes a
        stream and relays one of zeros of the true size, so that a timing study moves a run's
        bytes."""
        self.zeros = {k: torch.zeros(s) for k, s in shapes.items()}
        self.upstream_blocks: list[int] = list(upstream_blocks or [])
        self.tokens_per_step = tokens_per_step
        self.relay = relay
        self.relay_every = relay_every
        self.block = block
        self.relays_from = block - 1 if relay is not None and block > 0 else None
        self.relays_to = block + 1 if relay is not None and block < blocks - 1 else None
        self._steps = 0

    def load_stream(self, stream: RelayStream) -> None:
        pass

    def stream_out(self, metadata: dict[str, str]) -> StreamBody | None:
        if self.relay is None or self.relays_to is None or not self._steps:
            return None
        writer = StreamWriter(self.relay)
        x = torch.zeros(self.relay.batch, self.relay.seq_len, dtype=torch.long)
        u = torch.zeros(self.relay.batch, self.relay.seq_len, self.relay.d_model)
        for _ in range(relayed_steps(self._steps, self.relay_every)):  # what a worker relays
            writer.add(x, u)
        return writer.finish({"block": str(self.block), **metadata})

    def load(self, weights: Tensors) -> None:
        pass

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        pass

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        self._steps = steps
        return {"tokens": float(steps * self.tokens_per_step), "loss": math.nan, "steps": steps}

    def delta(self) -> Tensors:
        return self.zeros


@dataclass
class VirtualWorker:
    id: int
    block: int
    trainer: LocalTrainer
    encoder: DeltaEncoder  # its pushes, with its error-feedback residual (as a WorkerLoop's)
    speed: float
    down: float  # bytes per virtual second
    up: float
    last_round: int = -1  # the last round it trained on (or gave up on)
    holding: RoundView | None = None  # the round of the pull in flight
    told: int = 0  # the local steps that pull told it (`protocol.core.pacing`)
    held: View | None = None  # the weights it last pulled (compressed pulls are deltas from it)
    upstream: dict[int, Tensors] = field(default_factory=dict)  # route = features
    upstream_views: dict[int, View] = field(default_factory=dict)  # ... with a pull codec
    body: tuple[int, bytes] | None = None  # (round, body) of the push in flight
    stream: RelayStream | None = None  # route = relay: the stream it trains on
    stream_out: bytes | None = None  # ... and its round's stream, sent after its delta
    sent: int = 0  # the bytes of that push, with the stream out
    stopped: bool = False
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    dropped: int = 0
    local_steps: int = 0
    attacker: bool = False
    # an attacker's pushes: round, fate ("accepted" or the reason) and what it crafted
    pushes: list[dict[str, Any]] = field(default_factory=list)
    reported: dict[str, float] = field(default_factory=dict)  # ... of the push in flight

    def record(self) -> dict[str, Any]:
        """Its line in a simulation's summary."""
        return {
            "worker_id": self.id,
            "block": self.block,
            "speed": self.speed,
            "link_down_MBps": self.down / 1e6,
            "link_up_MBps": self.up / 1e6,
            "accepted": self.accepted,
            "refused": dict(sorted(self.refused.items())),
            "dropped": self.dropped,
            "local_steps": self.local_steps,
            "attacker": self.attacker,
            **({"pushes": self.pushes} if self.attacker else {}),
        }
