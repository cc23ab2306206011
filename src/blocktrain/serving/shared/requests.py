"""Reading a host's request: every malformed body, header or tensor is a 400 that says why,
before any computation starts."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ValidationError

from blocktrain.serving.shared.serving_errors import BadRequest
from blocktrain.serving.shared.wire import WIRE_DTYPES, WireError, decode

H = TypeVar("H", bound=BaseModel)


def read_message(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A request body -> (tensors, raw header); a 400 for anything malformed."""
    try:
        return decode(body)
    except WireError as exc:
        raise BadRequest(str(exc), code="bad_payload") from None


def read_header(cls: type[H], raw: dict[str, Any]) -> H:
    """The raw header as the message's pydantic model; a 400 naming the first bad field."""
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "header"
        raise BadRequest(
            f"message header: {where}: {first['msg']}", param=where, code="bad_payload"
        ) from None


def byte_input(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The (N, L) uint8 tensor `name` as int64 byte values."""
    t = tensors.get(name)
    if t is None or t.dtype != torch.uint8 or t.dim() != 2:
        raise BadRequest(f"'{name}' must be a (N, L) uint8 tensor of bytes", param=name)
    return t.long()


def state_input(
    tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], wire_dtype: str
) -> torch.Tensor:
    """The state tensor `name`, of exactly `shape` and the header's dtype and finite, as fp32."""
    t = tensors.get(name)
    if t is None or t.dtype != WIRE_DTYPES[wire_dtype] or tuple(t.shape) != shape:
        got = "nothing" if t is None else f"{t.dtype} {tuple(t.shape)}"
        raise BadRequest(f"'{name}' must be {wire_dtype} of shape {shape}; got {got}", param=name)
    if not torch.isfinite(t).all():
        raise BadRequest(f"'{name}' holds non-finite values", param=name)
    return t.float()
