"""How a pushed delta travels (`delta_wire`, flag `--wire`; docs/protocol.md, Compressed
deltas): dense in a float dtype, int8 with a scale per row, top-k, or sparse (chunked top-k,
low-bit values, packed indices, `sparse_codec`). Every codec writes plain safetensors parts
(NAME, NAME#scale, NAME#values, NAME#indices, NAME#scales) and a compressed body names its codec
in `__metadata__["delta_wire"]`. `decode` turns the parts back into dense tensors, refusing
(WireError) any that could open a hole (scales not finite, indices out of range or repeated);
the aggregator then validates the dense tensors as it does fp16 ones.

`DeltaEncoder` keeps a worker's error-feedback residual (as in DeMo and SparseLoCo), so that
over rounds everything a worker learned is sent."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blocktrain.protocol.core.delta_wire import DENSE, SEP, DeltaWire
from blocktrain.protocol.core.sparse_codec import layout, packed_len, sparse_decode, sparse_encode
from blocktrain.tensorwire import RawTensor, WireError

Tensors = dict[str, torch.Tensor]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The tensor as [rows, row length] (its first dimension; 0-d and 1-d are one row)."""
    return t.reshape(t.shape[0] if t.dim() >= 2 else 1, -1)


@dataclass(frozen=True)
class Compressed:
    wire: DeltaWire
    parts: Tensors
    """What travels, by part name."""
    sent: Tensors
    """The dense fp32 delta the aggregator will decode from `parts`."""


def compress(delta: Tensors, wire: DeltaWire) -> Compressed:
    """The parts of each tensor on the wire, and what they decode to."""
    parts: Tensors = {}
    sent: Tensors = {}
    for name, value in delta.items():
        x = value.detach().to("cpu", torch.float32)
        if wire.dense:
            parts[name] = x.to(DENSE[wire.kind][1])
            sent[name] = parts[name].float()
        elif wire.kind == "int8":
            rows = _rows(x)
            scale = rows.abs().amax(dim=1) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
            parts[name] = q.reshape(x.shape)
            parts[name + SEP + "scale"] = scale
            sent[name] = (q.float() * scale[:, None]).reshape(x.shape)
        elif wire.sparse:
            pieces, sent[name] = sparse_encode(x, wire)
            for part, t in pieces.items():
                parts[name + SEP + part] = t
        else:
            flat = x.reshape(-1)
            idx = torch.topk(flat.abs(), wire.k(flat.numel()), sorted=False).indices.sort().values
            values = flat[idx].to(torch.float16)
            parts[name + SEP + "values"] = values
            parts[name + SEP + "indices"] = idx.to(torch.int32)
            dense = torch.zeros_like(flat)
            dense[idx] = values.float()
            sent[name] = dense.reshape(x.shape)
    return Compressed(wire, parts, sent)


def expected_parts(
    shapes: dict[str, tuple[int, ...]], wire: DeltaWire
) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Part name -> (safetensors dtype code, shape; None where the sender chooses k)."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for name, shape in shapes.items():
        if wire.dense:
            out[name] = (DENSE[wire.kind][0], shape)
        elif wire.kind == "int8":
            out[name] = ("I8", shape)
            out[name + SEP + "scale"] = ("F32", (shape[0] if len(shape) >= 2 else 1,))
        elif wire.sparse:
            lay = layout(shape, wire)
            out[name + SEP + "scales"] = ("F16", (lay.chunks,))
            out[name + SEP + "values"] = ("U8", (packed_len(lay.kept, wire.bits),))
            out[name + SEP + "indices"] = ("U8", (packed_len(lay.kept, wire.index_bits),))
        else:
            out[name + SEP + "values"] = ("F16", None)
            out[name + SEP + "indices"] = ("I32", None)
    return out


def data_bytes(shapes: dict[str, tuple[int, ...]], wire: DeltaWire) -> int:
    """Bytes of tensor data in one push of a block of these shapes (top-k: k at the ratio)."""
    total = 0
    for shape in shapes.values():
        numel = math.prod(shape)
        if wire.dense:
            total += numel * DENSE[wire.kind][1].itemsize
        elif wire.kind == "int8":
            total += numel + 4 * (shape[0] if len(shape) >= 2 else 1)
        elif wire.sparse:
            lay = layout(shape, wire)
            total += 2 * lay.chunks + packed_len(lay.kept, wire.bits)
            total += packed_len(lay.kept, wire.index_bits)
        else:
            total += 6 * wire.k(numel)
    return total


def check_k(raw: dict[str, RawTensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Top-k parts: values and indices 1-d of one length k, with k no more than the tensor's
    size (WireError bad_k otherwise)."""
    for name, shape in shapes.items():
        values, indices = raw[name + SEP + "values"], raw[name + SEP + "indices"]
        numel = math.prod(shape)
        if len(values.shape) != 1 or values.shape != indices.shape:
            raise WireError(
                "bad_k",
                f"{name}: values {list(values.shape)} and indices {list(indices.shape)} must be "
                "1-d of one length k",
            )
        if values.shape[0] > numel:
            raise WireError("bad_k", f"{name}: k = {values.shape[0]} exceeds its {numel} values")


def decode(
    raw: dict[str, RawTensor], shapes: dict[str, tuple[int, ...]], wire: DeltaWire
) -> Tensors:
    """The dense delta of parts checked against `expected_parts` (and `check_k`): fp16/bf16 as
    they came, the others fp32. WireError bad_scales / bad_indices / malformed for parts that do not
    describe one tensor."""
    out: Tensors = {}
    for name, shape in shapes.items():
        if wire.dense:
            out[name] = raw[name].to_torch()
        elif wire.kind == "int8":
            scale = raw[name + SEP + "scale"].to_torch()
            if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
                raise WireError("bad_scales", f"{name}: a scale is NaN, Inf or negative")
            q = raw[name].to_torch()
            out[name] = (_rows(q).float() * scale[:, None]).reshape(shape)
        elif wire.sparse:
            out[name] = sparse_decode(
                name,
                raw[name + SEP + "scales"].to_torch(),
                raw[name + SEP + "values"].to_torch(),
                raw[name + SEP + "indices"].to_torch(),
                shape,
                wire,
            )
        else:
            values = raw[name + SEP + "values"].to_torch().float()
            idx = raw[name + SEP + "indices"].to_torch().long()
            numel = math.prod(shape)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
                raise WireError("bad_indices", f"{name}: an index lies outside 0..{numel - 1}")
            if idx.numel() > 1 and bool((idx[1:] <= idx[:-1]).any()):
                raise WireError("bad_indices", f"{name}: indices must be unique and ascending")
            dense = torch.zeros(numel, dtype=torch.float32)
            dense[idx] = values
            out[name] = dense.reshape(shape)
    return out


def declared(metadata: dict[str, str]) -> DeltaWire:
    """The codec a body that passed validation declares (dense when it names none), enough
    to `decode` it again (a restarted aggregator reads its pending bodies so)."""
    kind = metadata.get("delta_wire")
    if kind is None:
        return DeltaWire("fp16")
    return DeltaWire.parse(kind) if kind.startswith("sparse:") else DeltaWire(kind)


class DeltaEncoder:
    """A worker's pushes in one `delta_wire`, with its error-feedback residual (lossy codecs):
    each push sends compress(delta + beta x residual) and keeps what that did not send (beta:
    the sparse codec's decay, 1 for the others)."""

    def __init__(self, wire: str) -> None:
        self.name = wire
        self.wire = DeltaWire.parse(wire)
        self.residual: Tensors | None = None

    def compress(self, delta: Tensors) -> Compressed:
        if not self.wire.lossy:
            return compress(delta, self.wire)
        total = {k: v.detach().to("cpu", torch.float32) for k, v in delta.items()}
        if self.residual is not None:
            beta = self.wire.beta
            total = {k: v + beta * self.residual[k] for k, v in total.items()}
        out = compress(total, self.wire)
        self.residual = {k: v - out.sent[k] for k, v in total.items()}
        return out

    def reset(self) -> None:
        """Forget the residual: after a refusal the worker starts afresh from the aggregator's
        weights (its state, residual included, is suspect or out of date)."""
        self.residual = None
