"""What a worker trains and what drives it: the unit of a run (`UNITS`) and the interface of a
replica's trainer (`LocalTrainer`), which the worker loop and the simulator call alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from blocktrain.relaystream import RelayStream, StreamBody

Tensors = dict[str, torch.Tensor]

UNITS = ("block", "reference")
"""What a worker of a run trains: a block of the stack, or the end-to-end reference as the run's
one unit (DiLoCo's replica)."""


class LocalTrainer(Protocol):
    """What the loop needs of a block replica's trainer."""

    upstream_blocks: list[int]
    """The blocks whose latest versions it reads each round besides its own (`route =
    features`: the blocks before it); empty when only the noisy state passes."""

    def load(self, weights: Tensors) -> None:
        """Start a round from these weights (the optimizer state carries over)."""

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        """The versions of `upstream_blocks` this round reads, frozen."""

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool]
    ) -> dict[str, float]:
        """Run up to `steps` local updates; returns at least "tokens", "loss", "steps"."""
        ...

    def delta(self) -> Tensors:
        """theta_local - theta_base for the weights last loaded."""
        ...


@runtime_checkable
class ResumableTrainer(LocalTrainer, Protocol):
    """A trainer whose optimizer state a worker's folder keeps across restarts
    (`protocol.worker.resume`); `training.local.LocalBlockTrainer` is one."""

    steps_done: int

    def optimizer_state(self) -> Tensors:
        """The optimizer's state as flat tensors."""
        ...

    def load_optimizer_state(self, tensors: Tensors, steps_done: int = 0) -> None:
        """Carry on from a saved `optimizer_state`."""


@runtime_checkable
class RelayTrainer(LocalTrainer, Protocol):
    """A trainer of `route = relay` (docs/model.md): it trains on the stream the replicas of the
    block before relay, and relays its own; the loop and the simulator never look inside a stream."""

    relays_from: int | None
    """The block whose stream it trains on (None: it draws its own batches, as block 0)."""
    relays_to: int | None
    """The block its own stream is for (None: the last block relays nothing)."""

    def load_stream(self, stream: RelayStream) -> None:
        """The stream this round trains on (step i reads the stream's step i, wrapping)."""

    def stream_out(self, metadata: dict[str, str]) -> StreamBody | None:
        """The stream of the round just trained, with `metadata`; None when it relays nothing
        or trained no step."""
        ...
