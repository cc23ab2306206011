"""What the aggregator answers a worker, as its client reads it: a registration, a pull, a
push's verdict, the round's headers (`X-Deadline-In`, `X-Local-Steps`) and a version's body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import torch

from blocktrain.errors import ProtocolError
from blocktrain.protocol.core.bodies import WireError, decode
from blocktrain.protocol.core.delta_wire import FULL

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Registration:
    worker_id: int
    block: int
    data_seed: int
    local_steps: int
    wire_dtype: str
    delta_wire: str
    """How pushes carry deltas (an aggregator that does not say takes wire_dtype)."""
    pull_wire: str = FULL
    """How pulls travel: whole versions, or deltas from the view held (`protocol.core.pulls`)."""
    exact_pulls: bool = False
    """Each version is committed as the pull codec carries it: views are fp32, and a delta is
    from the version before only (`protocol.core.pulls`)."""


@dataclass(frozen=True)
class Pulled:
    tensors: Tensors
    block: int
    version: int
    round: int
    deadline_in: float | None
    nbytes: int
    local_steps: int | None = None
    """The steps this worker is told to run this round (`X-Local-Steps`, adaptive pacing);
    None from an aggregator that does not say: the registration's H."""


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    reason: str
    detail: str
    status: int
    nbytes: int
    body: dict[str, Any]


def fp32(tensors: Tensors) -> Tensors:
    """The trainer's own fp32 copy (the held tensors stay as they arrived)."""
    return {k: v.float() if v.dtype != torch.float32 else v.clone() for k, v in tensors.items()}


def seconds(headers: httpx.Headers) -> float | None:
    """X-Deadline-In: the seconds left in the round (None before its clock started)."""
    value = headers.get("X-Deadline-In") or None
    return None if value is None else float(value)


def told_steps(headers: httpx.Headers) -> int | None:
    """X-Local-Steps: the steps this pull tells the worker to run (None: not said)."""
    value = headers.get("X-Local-Steps") or None
    return None if value is None else int(value)


def version_body(body: bytes, url: str, block: int, version: int) -> Tensors:
    """The tensors of a committed version's body (the wire dtype), refused unless it names that
    version."""
    try:
        decoded = decode(body)
    except WireError as exc:
        raise ProtocolError(f"the aggregator sent unreadable weights: {exc.detail}") from exc
    meta = decoded.metadata
    if (meta.get("block"), meta.get("version")) != (str(block), str(version)):
        raise ProtocolError(
            f"{url} holds block {meta.get('block')} version {meta.get('version')}, "
            f"not block {block} version {version}"
        )
    return decoded.to_torch()
