"""Tensors in an HTTP body, read safely: one safetensors file, nothing else. The aggregator's
protocol and the serving chain both build their messages on this (protocol/wire.py with string
metadata, serving/wire.py with a JSON header); one parser, one error, one media type.

Bodies are parsed by safetensors' own parser (`safetensors.deserialize`), which checks the
header, the offsets and that the data covers the body exactly; nothing here, or anywhere in
BlockTrain, unpickles. A body that looks like a pickle or a `torch.save` archive is refused with
its own reason so that the sender learns what went wrong.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, deserialize
from safetensors.torch import save

CONTENT_TYPE = "application/vnd.safetensors"
"""The media type of every tensor body (requests and responses, protocol and serving)."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
}
"""The safetensors dtype codes a body may hold, and their torch dtypes."""


class WireError(ValueError):
    """A body that cannot be read: `reason` is a short code (the protocol's refusal reasons use
    it), `detail` says what was wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RawTensor:
    """One tensor as the header described it, its bytes not yet interpreted."""

    dtype: str
    """The safetensors dtype code, e.g. "F16"."""
    shape: tuple[int, ...]
    data: bytes | bytearray

    def to_torch(self) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(self.dtype)
        if dtype is None:
            raise WireError("bad_dtype", f"dtype {self.dtype} is not one BlockTrain sends")
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        # The parser hands out a fresh bytearray: share it rather than copy it again.
        buf = self.data if isinstance(self.data, bytearray) else bytearray(self.data)
        return torch.frombuffer(buf, dtype=dtype).reshape(self.shape)


@dataclass(frozen=True)
class Decoded:
    """A parsed body: tensors by name, and the `__metadata__` strings."""

    tensors: dict[str, RawTensor]
    metadata: dict[str, str]

    def to_torch(self) -> dict[str, torch.Tensor]:
        return {name: raw.to_torch() for name, raw in self.tensors.items()}


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors body of the tensors (moved to the CPU, contiguous) and string metadata."""
    return save(
        {name: t.detach().cpu().contiguous() for name, t in tensors.items()}, metadata=metadata
    )


def looks_like_pickle(body: bytes) -> bool:
    """A pickle (protocol 2+ starts with PROTO) or a zip, which is what torch.save writes."""
    return (len(body) >= 2 and body[0] == 0x80 and 2 <= body[1] <= 5) or body.startswith(
        b"PK\x03\x04"
    )


def decode(body: bytes, *, max_bytes: int | None = None) -> Decoded:
    """Parse a safetensors body, refusing (WireError) anything oversized, pickled or malformed."""
    if max_bytes is not None and len(body) > max_bytes:
        raise WireError("too_large", f"the body holds {len(body)} bytes; the limit is {max_bytes}")
    if looks_like_pickle(body):
        raise WireError(
            "pickle",
            "the body is a pickle or torch.save archive; send safetensors "
            "(blocktrain never unpickles)",
        )
    if len(body) < 8:
        raise WireError(
            "malformed",
            f"the body holds {len(body)} bytes; a safetensors file "
            "starts with an 8-byte header length",
        )
    try:
        entries = deserialize(body)
    except (SafetensorError, ValueError, OverflowError, TypeError) as exc:
        raise WireError("malformed", f"not a complete safetensors body: {exc}") from None
    # The parser has validated the header; read its metadata, which `deserialize` omits.
    (header_len,) = struct.unpack("<Q", body[:8])
    try:
        header = json.loads(body[8 : 8 + header_len])
    except (ValueError, UnicodeDecodeError) as exc:  # pragma: no cover - parser checked it
        raise WireError("malformed", f"unreadable header: {exc}") from None
    raw_meta = header.get("__metadata__") or {}
    if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
        raise WireError("bad_metadata", "__metadata__ must map names to strings")
    tensors = {
        name: RawTensor(info["dtype"], tuple(int(d) for d in info["shape"]), info["data"])
        for name, info in entries
    }
    return Decoded(tensors, dict(raw_meta))
