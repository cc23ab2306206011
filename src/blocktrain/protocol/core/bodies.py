"""The protocol's tensors on the wire: safetensors bodies (`blocktrain.tensorwire`, the one
safe parser) with string metadata, cast to fp16/bf16/fp32."""

from __future__ import annotations

import torch

from blocktrain import tensorwire
from blocktrain.protocol.core.codecs import Compressed, compress
from blocktrain.protocol.core.delta_wire import DENSE, DeltaWire
from blocktrain.tensorwire import CONTENT_TYPE, Decoded, RawTensor, WireError, decode

__all__ = [
    "CONTENT_TYPE",
    "SAFETENSORS_CODES",
    "WIRE_DTYPES",
    "Decoded",
    "RawTensor",
    "WireError",
    "decode",
    "encode",
    "metadata_float",
    "metadata_int",
    "update_body",
    "wire_dtype",
]

WIRE_DTYPES: dict[str, torch.dtype] = {name: dtype for name, (_, dtype) in DENSE.items()}
"""Wire dtype names -> torch dtypes."""

SAFETENSORS_CODES: dict[str, str] = {name: code for name, (code, _) in DENSE.items()}
"""Wire dtype names -> the dtype codes in a safetensors header."""


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
    cast = {name: t.detach().to("cpu", target) for name, t in tensors.items()}
    return tensorwire.encode(cast, {k: str(v) for k, v in metadata.items()})


def update_body(
    block: int,
    delta: dict[str, torch.Tensor] | Compressed,
    *,
    base_version: int,
    round: int,
    tokens: int,
    loss: float | None = None,
    worker_id: int | None = None,
    dtype: str = "fp16",
    steps: int | None = None,
) -> bytes:
    """The body of a push: the delta in the delta wire `dtype` (see `codecs`), or already
    compressed by a worker's `codecs.DeltaEncoder`, with the metadata the validators read (`steps`:
    the local steps it took)."""
    if not isinstance(delta, Compressed):
        delta = compress(delta, DeltaWire.parse(dtype))
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
    if steps is not None:
        meta["steps"] = steps
    if not delta.wire.dense:
        meta["delta_wire"] = delta.wire.tag
    return tensorwire.encode(delta.parts, {k: str(v) for k, v in meta.items()})


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


def version_path(block: int, version: int) -> str:
    """The immutable URL path of a committed version's weights."""
    return f"/v1/blocks/{block}/versions/{version}"
