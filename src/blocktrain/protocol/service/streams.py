"""Relayed streams at the aggregator (`route = relay`; docs/protocol.md, "Relayed streams"), a
mixin of `AggregatorService`: who may push a stream (a worker of the block, for a round whose
update was accepted or refused for its timing only) and its size cap; `core.relays.RelayPool`
decides who takes which. In memory only: after a restart the next block's workers wait for the
next round's streams."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from blocktrain.config import TrainConfig
from blocktrain.protocol.core.relays import TIMING_REASONS, Relayed, RelayPool
from blocktrain.protocol.core.verdict import refused
from blocktrain.protocol.service.identity import Caller
from blocktrain.protocol.store.ledger import Ledger
from blocktrain.relaystream import Shape, bytes_per_step
from blocktrain.tensorwire import WireError

STREAM_HEADER_BYTES = 64 * 1024
"""Room for a stream's header in its size cap."""
STEPS_SLACK = 2
"""A stream may hold up to this many times H steps (adaptive pacing tells more or fewer)."""


def stream_shape(run_config: dict[str, Any]) -> Shape | None:
    """What a step of this run's streams holds, under `route = relay`; else None."""
    model = run_config.get("model", {})
    if model.get("route") != "relay":
        return None
    train = run_config["train"]
    bits = int(train.get("relay_bits", TrainConfig.relay_bits))  # saved before relay_bits: 8
    return Shape(int(train["batch_size"]), int(model["seq_len"]), int(model["d_model"]), bits)


class Streams:
    """The relay pools of the blocks served here that relay (all but the last)."""

    ledger: Ledger
    lock: threading.RLock
    n_blocks: int
    run_config: dict[str, Any]
    clock: Callable[[], float]

    def _init_streams(self, served: list[int], local_steps: int) -> None:
        shape = stream_shape(self.run_config)
        self.stream_shape = shape
        self.max_stream_body = (
            0
            if shape is None
            else STEPS_SLACK
            * local_steps
            * bytes_per_step(shape.batch, shape.seq_len, shape.d_model, shape.bits)
            + STREAM_HEADER_BYTES
        )
        self.relays: dict[int, RelayPool] = (
            {}
            if shape is None
            else {b: RelayPool(b, shape) for b in served if b < self.n_blocks - 1}
        )
        self.on_stream: list[Callable[[int], None]] = []
        """Called with the block of each stream kept (long polls wake on it)."""

    def _pool(self, block: int) -> RelayPool:
        self.check_block(block)  # type: ignore[attr-defined]
        pool = self.relays.get(block)
        if pool is None:
            why = (
                "this run does not relay streams (route is not relay)"
                if self.stream_shape is None
                else f"block {block} is the last block: it relays nothing"
            )
            raise refused("not_relayed", why)
        return pool

    def put_stream(
        self, *, caller: Caller, block: int, round: int, body: bytes | bytearray
    ) -> dict[str, Any]:
        """Keep worker `caller`'s stream of round `round` of `block`, once its update of that
        round was accepted or refused for its timing only; refused (`not_relayed`,
        `no_update`, or what the stream's check says) otherwise."""
        worker = self._worker_on(caller, block)  # type: ignore[attr-defined]
        pool = self._pool(block)
        mine = [u for u in self.ledger.updates(block=block, round=round) if u.worker_id == worker]
        if not any(u.fate == "accepted" or u.reason in TIMING_REASONS for u in mine):
            raise refused(
                "no_update",
                f"worker {worker} has no update of round {round} of block {block} that was "
                "accepted or refused for its timing; push the delta first",
            )
        try:
            with self.lock:
                relayed = pool.put(round, worker, bytes(body), max_body=self.max_stream_body)
        except WireError as exc:
            raise refused(
                exc.reason if exc.reason in _REASONS else "malformed", exc.detail
            ) from None
        for notify in self.on_stream:
            notify(block)
        return {"accepted": True, "block": block, "round": round, "steps": relayed.steps}

    def take_stream(self, *, taker: tuple[int, str], block: int) -> Relayed | None:
        """A stream of `block` for `taker` (its token and worker id, as it names itself: the
        worker may be registered at another aggregator of the run); once the block is done, the
        newest again rather than none."""
        pool = self._pool(block)
        done = self.blocks[block].rounds.done  # type: ignore[attr-defined]
        with self.lock:
            return pool.take(taker, reuse=done)


_REASONS = frozenset({"too_large", "pickle", "malformed", "bad_dtype", "bad_shape", "non_finite"})
"""Refusals of a stream's body, as `relaystream.check` names them (verdict.REASONS)."""
