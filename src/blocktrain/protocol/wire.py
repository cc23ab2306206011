"""Tensors on the wire: safetensors bodies with string metadata, cast to fp16/bf16/fp32.

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

WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
"""Wire dtype names -> torch dtypes."""

SAFETENSORS_CODES: dict[str, str] = {"fp16": "F16", "bf16": "BF16", "fp32": "F32"}
"""Wire dtype names -> the dtype codes in a safetensors header."""

_CODE_TO_TORCH = {code: WIRE_DTYPES[name] for name, code in SAFETENSORS_CODES.items()}

CONTENT_TYPE = "application/vnd.safetensors"
"""The media type of every tensor body (requests and responses)."""


class WireError(ValueError):
    """A body that cannot be read; `reason` is a code of `verdict.REASONS`."""

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
        """The tensor (fp16, bf16 or fp32 only; the validators refuse anything else first)."""
        dtype = _CODE_TO_TORCH.get(self.dtype)
        if dtype is None:
            raise WireError("bad_dtype", f"dtype {self.dtype} is not a wire dtype")
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


def wire_dtype(name: str) -> torch.dtype:
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"wire dtype {name!r} is not one of {', '.join(WIRE_DTYPES)}") from None


def encode(
    tensors: dict[str, torch.Tensor], metadata: dict[str, object], dtype: str = "fp16"
) -> bytes:
    """A safetensors body: every tensor cast to the wire dtype, metadata values as strings."""
    target = wire_dtype(dtype)
    cast = {name: t.detach().to("cpu", target).contiguous() for name, t in tensors.items()}
    return save(cast, metadata={k: str(v) for k, v in metadata.items()})


def update_body(
    block: int,
    delta: dict[str, torch.Tensor],
    *,
    base_version: int,
    round: int,
    tokens: int,
    loss: float | None = None,
    worker_id: int | None = None,
    dtype: str = "fp16",
) -> bytes:
    """The body of a push: the delta in the wire dtype, with the metadata the aggregator's
    validators read (the simulator builds its pushes with this too)."""
    meta: dict[str, object] = {
        "block": block,
        "base_version": base_version,
        "round": round,
        "tokens": tokens,
    }
    if loss is not None:
        meta["loss"] = f"{loss:.6f}"
    if worker_id is not None:
        meta["worker_id"] = worker_id
    return encode(delta, meta, dtype)


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


def metadata_int(metadata: dict[str, str], key: str) -> int:
    """An integer metadata value; WireError(bad_metadata) when missing or not an integer."""
    if key not in metadata:
        raise WireError("bad_metadata", f"__metadata__ has no {key!r}")
    text = metadata[key].strip()
    try:
        return int(text)
    except ValueError:
        raise WireError(
            "bad_metadata", f"__metadata__[{key!r}] = {text[:40]!r} is not an integer"
        ) from None


def metadata_float(metadata: dict[str, str], key: str) -> float | None:
    """An optional float metadata value (None when absent or unreadable)."""
    try:
        return float(metadata[key])
    except (KeyError, ValueError):
        return None
