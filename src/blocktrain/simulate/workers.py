"""The simulator's virtual workers: what the event loop (`simulate/engine.py`) keeps per worker,
and `TimingOnlyTrainer`, a local trainer with no compute for timing and participation studies.
Attackers' trainers are `simulate/attacks/`'s."""

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

Tensors = dict[str, torch.Tensor]


class TimingOnlyTrainer:
    """No compute: zero deltas with honest token counts, for timing and participation studies
    (`blocktrain simulate --timing-only`) and tests."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        tokens_per_step: int,
        upstream_blocks: list[int] | None = None,
    ) -> None:
        """`upstream_blocks`: the blocks whose versions it pulls with its own, as a real
        worker's (route = features); it reads nothing of them."""
        self.zeros = {k: torch.zeros(s) for k, s in shapes.items()}
        self.upstream_blocks: list[int] = list(upstream_blocks or [])
        self.tokens_per_step = tokens_per_step

    def load(self, weights: Tensors) -> None:
        pass

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        pass

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        return {"tokens": float(steps * self.tokens_per_step), "loss": math.nan, "steps": steps}

    def delta(self) -> Tensors:
        return self.zeros


@dataclass
class VirtualWorker:
    id: int
    block: int
    trainer: LocalTrainer
    encoder: DeltaEncoder
    """Its pushes in the delta wire, with its error-feedback residual (as a WorkerLoop's)."""
    speed: float
    down: float
    """Its download rate, bytes per virtual second."""
    up: float
    """Its upload rate, bytes per virtual second."""
    last_round: int = -1
    """The last round it trained on (or gave up on); it waits for a later one."""
    holding: RoundView | None = None
    """The round of the pull in flight (its weights: `held`)."""
    told: int = 0
    """The local steps that pull told it (`protocol.core.pacing`)."""
    held: View | None = None
    """The weights it last pulled, as they arrived (compressed pulls are deltas from it)."""
    upstream: dict[int, Tensors] = field(default_factory=dict)
    """The committed versions of its trainer's upstream blocks, pulled with its own."""
    upstream_views: dict[int, View] = field(default_factory=dict)
    """With a pull codec: the view it holds of each upstream block (the next read is a delta
    from it)."""
    body: tuple[int, bytes] | None = None
    """(round, body) of the push in flight."""
    sent: int = 0
    """The bytes of that push (with, under relay, the round's stream out)."""
    stopped: bool = False
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    dropped: int = 0
    local_steps: int = 0
    attacker: bool = False
    pushes: list[dict[str, Any]] = field(default_factory=list)
    """An attacker's pushes: each one's round, its fate ("accepted" or the refusal's reason)
    and what its trainer reported beyond tokens, loss and steps (what it crafted)."""
    reported: dict[str, float] = field(default_factory=dict)
    """Those extra numbers of the push in flight."""
