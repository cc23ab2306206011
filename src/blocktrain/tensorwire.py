"""Tensors in an HTTP body, read safely: one safetensors file, nothing else, parsed here for
the protocol (core/bodies.py) and the serving chain (serving/shared/wire.py) alike. Bodies are
parsed from a view, so that a pushed delta is never copied after it was read; nothing in
BlockTrain unpickles, and a body that looks like a pickle or a `torch.save` archive gets its
own reason so that the sender learns what went wrong."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch
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
    """One tensor as the header described it, its bytes not yet interpreted: a view into the
    body when it was parsed from a writable buffer (no copy), else bytes."""

    dtype: str
    """The safetensors dtype code, e.g. "F16"."""
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    def to_torch(self) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(self.dtype)
        if dtype is None:
            raise WireError("bad_dtype", f"dtype {self.dtype} is not one BlockTrain sends")
        if not len(self.data):
            return torch.empty(self.shape, dtype=dtype)
        buf = self.data
        if isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly):
            buf = bytearray(buf)  # torch shares only writable buffers
        t = torch.frombuffer(buf, dtype=dtype).reshape(self.shape)
        # A tensor sharing the body starts wherever the sender put it; aligned, it stays shared.
        return t if t.data_ptr() % dtype.itemsize == 0 else t.clone()


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
    """A pickle (protocol 2+ starts with PROTO) or a zip, which is what torch.save writes; not a
    safetensors file whose header length happens to start with those bytes (640 bytes is
    80 02 ...): its ninth byte opens the JSON header, `{`, which is no pickle opcode and no
    zip's compression method."""
    if len(body) >= 9 and body[8] == ord("{"):
        return False
    return (len(body) >= 2 and body[0] == 0x80 and 2 <= body[1] <= 5) or body.startswith(
        b"PK\x03\x04"
    )


MAX_HEADER_BYTES = 100_000_000
"""The largest header safetensors itself reads."""

BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16,
    "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64,
    "F64": 64, "C64": 64,
}  # fmt: skip
"""The dtype codes the parser knows, and their bits per value (the whole-byte ones of
safetensors; a body with another code is malformed here, and no BlockTrain reader takes one)."""

U64 = 1 << 64

Body = bytes | bytearray | memoryview


def decode(body: Body, *, max_bytes: int | None = None) -> Decoded:
    """Parse a safetensors body, refusing (WireError) anything oversized, pickled or malformed.
    The checks are safetensors' own (its Rust `Metadata::validate`; test_tensorwire_parse.py holds
    this to its verdicts): the header within the body and at most 100 MB, string metadata, known
    dtypes, and `data_offsets` that tile the data exactly. Each `RawTensor.data` is a view into
    `body`, not a copy."""
    view = memoryview(body).cast("B")
    size = len(view)
    if max_bytes is not None and size > max_bytes:
        raise WireError("too_large", f"the body holds {size} bytes; the limit is {max_bytes}")
    if looks_like_pickle(view[:9].tobytes()):
        raise WireError(
            "pickle",
            "the body is a pickle or torch.save archive; send safetensors "
            "(blocktrain never unpickles)",
        )
    if size < 8:
        raise WireError(
            "malformed",
            f"the body holds {size} bytes; a safetensors file starts with an 8-byte header length",
        )
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise _malformed(f"the header length {header_len} does not fit the body of {size} bytes")
    header = _header(view[8 : 8 + header_len])
    raw_meta = header.pop("__metadata__", None)
    if raw_meta is None:
        raw_meta = {}
    if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
        raise _malformed("__metadata__ must map names to strings")
    data = view[8 + header_len :]
    entries = sorted(
        ((name, _info(name, info)) for name, info in header.items()), key=lambda e: e[1][2]
    )
    start = 0
    tensors = {}
    for name, (dtype, shape, (begin, end)) in entries:
        if begin != start or end < begin:
            raise _malformed(f"{name[:80]!r}: data_offsets do not follow on")
        if math.prod(shape) * BITS[dtype] != 8 * (end - begin):
            raise _malformed(f"{name[:80]!r}: its shape and data_offsets disagree")
        start = end
        tensors[name] = RawTensor(dtype, shape, data[begin:end])
    if start != len(data):
        raise _malformed(f"the tensors cover {start} of the {len(data)} data bytes of the body")
    return Decoded(tensors, dict(raw_meta))


def _malformed(why: str) -> WireError:
    return WireError("malformed", f"not a complete safetensors body: {why}")


def _header(raw: memoryview) -> dict[str, object]:
    """The header's JSON object: strict JSON (no NaN, no duplicate keys, valid UTF-8)."""

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        out = dict(items)
        if len(out) != len(items):
            raise ValueError("a key is repeated")
        for key, value in items:  # \ud800 escapes decode to strings that are not UTF-8
            key.encode()
            if isinstance(value, str):
                value.encode()
        return out

    def constant(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    try:
        text = raw.tobytes().decode("utf-8")
        header = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, RecursionError) as exc:
        raise _malformed(f"unreadable header: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise _malformed("the header is not a JSON object")
    return header


def _info(name: str, info: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one tensor's header entry (WireError when malformed)."""
    if not isinstance(info, dict):
        raise _malformed(f"{name[:80]!r}: not a tensor description")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in BITS:
        raise _malformed(f"{name[:80]!r}: unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(_u64(d) for d in shape):
        raise _malformed(f"{name[:80]!r}: the shape is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_u64(o) for o in offsets):
        raise _malformed(f"{name[:80]!r}: data_offsets is not [begin, end]")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < U64
