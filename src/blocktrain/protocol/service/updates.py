"""What the service's push and pull paths carry: a push's context once its caller is known, a
pull's reply, and the ledger columns an update's metadata fills."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from blocktrain.protocol.core.events import Checked
from blocktrain.protocol.core.rounds import RoundView
from blocktrain.protocol.core.validation import UpdateMeta


@dataclass(frozen=True)
class PushContext:
    received: float
    token_id: int
    worker_id: int
    block: int


@dataclass(frozen=True)
class PullReply:
    """The body of a pull (the weights in the wire dtype), the round it serves, and the local
    steps its worker is told to run (`pacing`)."""

    body: bytes
    view: RoundView
    deadline_in: float | None
    local_steps: int


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def update_fields(meta: UpdateMeta, checked: Checked) -> dict[str, Any]:
    """The ledger columns an update's metadata fills, accepted or refused."""
    norm = None if checked.candidate is None else checked.candidate.norm
    return {
        "round": meta.round,
        "base_version": meta.base_version,
        "tokens": meta.tokens,
        "loss": finite(meta.loss),
        "norm": finite(norm),
    }
