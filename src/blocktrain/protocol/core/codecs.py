"""How a pushed delta travels (the aggregator setting `delta_wire`, flag `--wire`): dense in a
float dtype, int8 with a scale per row, top-k with error feedback kept on the worker, or sparse:
chunked top-k with low-bit values and packed indices (docs/protocol.md, Compressed deltas).

Every codec writes plain safetensors tensors; a block tensor NAME travels as these parts:

    fp16 | bf16 | fp32   NAME            the delta in that dtype (as before compression existed)
    int8                 NAME            I8, the block tensor's shape: round(x / scale)
                         NAME#scale      F32 [rows]: max |x| of the row / 127 (rows = the first
                                         dimension; a 0-d or 1-d tensor is one row)
    topk:RATIO           NAME#values     F16 [k]: the k largest-magnitude coordinates
                         NAME#indices    I32 [k]: their flat indices, ascending, unique
                                         (k = ceil(RATIO x numel), at least 1)
    sparse:DENSITY:BITS  NAME#scales      F16 [chunks]: max |x| of each chunk
                         NAME#values      U8: the kept values' BITS-bit codes, packed
                         NAME#indices     U8: their indices within their chunk, packed

and a compressed body says which codec it is in `__metadata__["delta_wire"]` ("int8", "topk",
or for sparse the codec without its worker-side `beta`, e.g. "sparse:0.03:2").
`decode` turns the parts back into dense fp32 tensors, refusing (WireError) parts that could
open a hole: scales not finite or negative, indices out of range or repeated, a k beyond the
tensor. The aggregator then validates the dense tensors exactly as it does fp16 ones.

`DeltaEncoder` is what the worker (`protocol.worker.loop`) and the simulator push with: for a lossy
codec it adds the residual of the last push (what was not sent) to the new delta before it
compresses, and keeps the new residual (error feedback, as in DeMo and SparseLoCo), so that over
rounds everything a worker learned is sent. The sparse codec's `beta` decays that residual
(delta + beta x residual is compressed; beta = 1 is the plain accumulation of the others).

The sparse codec (after SparseLoCo and DeMo) cuts a matrix [rows, rest] into CHUNK x CHUNK
tiles (a vector, or a 0-d tensor, into flat chunks of CHUNK^2), keeps the k = ceil(DENSITY x n)
largest magnitudes of each chunk of n values (at least 1), and sends each kept value as a sign
and a BITS - 1 bit magnitude level m: value = sign x scale x (m + 1) / 2^(BITS - 1), with scale
the chunk's max |x| in fp16. No level is zero, so a kept coordinate decodes non-zero whenever
its chunk's scale is; the aggregator's mean of sparse votes counts, per coordinate, only the
votes whose value there is non-zero (`aggregation.weighted_mean`, per_coordinate).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from blocktrain.tensorwire import RawTensor, WireError

Tensors = dict[str, torch.Tensor]

DENSE: dict[str, tuple[str, torch.dtype]] = {
    "fp16": ("F16", torch.float16),
    "bf16": ("BF16", torch.bfloat16),
    "fp32": ("F32", torch.float32),
}
"""Dense wire names -> (safetensors code, torch dtype)."""
SEP = "#"
"""Separates a block tensor's name from its part (never in a PyTorch parameter name)."""
WIRE_HELP = (
    "fp16, bf16, fp32, int8, topk:RATIO with 0 < RATIO < 1 (e.g. topk:0.1) or "
    "sparse:DENSITY[:BITS][:chunk=C][:beta=B] with 0 < DENSITY < 1, BITS 2, 4 or 8 (default 4), "
    "C 2..1024 (default 64) and 0 <= B <= 1 (default 1) (e.g. sparse:0.03:2)"
)
SPARSE_BITS = (2, 4, 8)
SPARSE_DEFAULT_BITS = 4
SPARSE_CHUNK = 64
"""Default chunk side: 64 x 64 tiles of a matrix, flat chunks of 64^2 = 4096 of a vector."""
SPARSE_CHUNK_RANGE = (2, 1024)


def _sparse_args(args: list[str]) -> tuple[float, int, int, float] | None:
    """(density, bits, chunk, beta) of sparse's arguments, None when they are not valid."""
    try:
        density = float(args[0])
        bits, chunk, beta = SPARSE_DEFAULT_BITS, SPARSE_CHUNK, 1.0
        rest = args[1:]
        if rest and "=" not in rest[0]:
            bits = int(rest.pop(0))
        seen = set()
        for arg in rest:
            key, eq, value = arg.partition("=")
            if not eq or key in seen:
                return None
            seen.add(key)
            if key == "chunk":
                chunk = int(value)
            elif key == "beta":
                beta = float(value)
            else:
                return None
    except (ValueError, IndexError):
        return None
    lo, hi = SPARSE_CHUNK_RANGE
    if 0 < density < 1 and bits in SPARSE_BITS and lo <= chunk <= hi and 0 <= beta <= 1:
        return density, bits, chunk, beta
    return None


@dataclass(frozen=True)
class DeltaWire:
    """A parsed `delta_wire`: the codec `kind` (a dense name, int8, topk or sparse), top-k's
    ratio or sparse's density, and sparse's bits per value, chunk side and error-feedback
    decay `beta` (a worker-side setting: it changes nothing on the wire)."""

    kind: str
    ratio: float = 1.0
    bits: int = 0
    chunk: int = 0
    beta: float = 1.0

    @staticmethod
    def parse(text: str) -> DeltaWire:
        """ "fp16", "int8", "topk:0.1", "sparse:0.03:2", ...; ValueError naming what is
        accepted otherwise."""
        name, _, arg = str(text).strip().partition(":")
        if name in DENSE or name == "int8":
            if not arg:
                return DeltaWire(name)
        elif name == "topk":
            try:
                ratio = float(arg)
            except ValueError:
                ratio = math.nan
            if 0 < ratio < 1:
                return DeltaWire(name, ratio)
        elif name == "sparse":
            parsed = _sparse_args(arg.split(":"))
            if parsed is not None:
                density, bits, chunk, beta = parsed
                return DeltaWire(name, density, bits, chunk, beta)
        raise ValueError(f"delta wire {text!r} is not one of {WIRE_HELP}")

    def __str__(self) -> str:
        """The text `parse` reads back."""
        if self.kind == "sparse":
            text = f"sparse:{self.ratio!r}:{self.bits}"
            if self.chunk != SPARSE_CHUNK:
                text += f":chunk={self.chunk}"
            return text + (f":beta={self.beta!r}" if self.beta != 1.0 else "")
        return f"{self.kind}:{self.ratio:g}" if self.kind == "topk" else self.kind

    @property
    def tag(self) -> str:
        """What a body in this codec says in `__metadata__["delta_wire"]`: the kind, and for
        sparse everything its parts' layout depends on (not beta)."""
        return str(replace(self, beta=1.0)) if self.kind == "sparse" else self.kind

    def same_body(self, tag: str) -> bool:
        """Whether a body declaring `tag` is in this codec (sparse: the same density, bits
        and chunk, however written)."""
        if self.kind != "sparse":
            return tag == self.tag
        try:
            other = DeltaWire.parse(tag)
        except ValueError:
            return False
        return replace(other, beta=1.0) == replace(self, beta=1.0)

    @property
    def sparse(self) -> bool:
        return self.kind == "sparse"

    @property
    def dense(self) -> bool:
        return self.kind in DENSE

    @property
    def lossy(self) -> bool:
        """Loses more than float rounding: the worker keeps the residual."""
        return not self.dense

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    @property
    def index_bits(self) -> int:
        """Bits of one packed index of the sparse codec: enough for CHUNK^2 - 1."""
        return max(1, (self.chunk * self.chunk - 1).bit_length())


def valid_wire(text: object) -> bool:
    try:
        DeltaWire.parse(str(text))
    except ValueError:
        return False
    return True


FULL = "full"
"""The pull wire (`pull_wire`) that sends every version whole, in the weights' dtype."""


def pull_codec(text: str) -> DeltaWire | None:
    """A `pull_wire`: None for "full", else a lossy codec (ValueError for anything else)."""
    if text == FULL:
        return None
    wire = DeltaWire.parse(text)
    if not wire.lossy:
        raise ValueError(f"pull wire {text!r}: a dense pull is the whole version, say {FULL!r}")
    return wire


def valid_pull_wire(text: object) -> bool:
    try:
        pull_codec(str(text))
    except ValueError:
        return False
    return True


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The tensor as [rows, row length] (its first dimension; 0-d and 1-d are one row)."""
    return t.reshape(t.shape[0] if t.dim() >= 2 else 1, -1)


# ---------------------------------------------------------------------- the sparse codec


@dataclass(frozen=True)
class Layout:
    """How the sparse codec cuts one tensor: viewed as [rows, cols] (a matrix: its first
    dimension and the rest; a vector or 0-d tensor: one row), into tiles of tile_h x tile_w
    (CHUNK x CHUNK, or 1 x CHUNK^2 for one row), numbered row-major over the tile grid; edge
    tiles are smaller. `heights`, `widths`, `ks`: per chunk, in that order."""

    rows: int
    cols: int
    tile_h: int
    tile_w: int
    grid: tuple[int, int]
    heights: tuple[int, ...]
    widths: tuple[int, ...]
    ks: tuple[int, ...]

    @property
    def chunks(self) -> int:
        return len(self.ks)

    @property
    def kept(self) -> int:
        return sum(self.ks)


@functools.lru_cache(maxsize=4096)
def layout(shape: tuple[int, ...], wire: DeltaWire) -> Layout:
    if len(shape) >= 2:
        rows, cols, th, tw = shape[0], math.prod(shape[1:]), wire.chunk, wire.chunk
    else:
        rows, cols, th, tw = 1, math.prod(shape), 1, wire.chunk * wire.chunk
    nr, nc = -(-rows // th), -(-cols // tw)
    hs = [min(th, rows - i * th) for i in range(nr)]
    ws = [min(tw, cols - j * tw) for j in range(nc)]
    heights = tuple(h for h in hs for _ in ws)
    widths = tuple(w for _ in hs for w in ws)
    ks = tuple(wire.k(h * w) for h, w in zip(heights, widths, strict=True))
    return Layout(rows, cols, th, tw, (nr, nc), heights, widths, ks)


def packed_len(n: int, bits: int) -> int:
    """Bytes of n codes of `bits` bits each, packed (`pack`)."""
    return -(-n * bits // 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers < 2^bits as one bit stream, little-endian: code j holds bits
    j*bits .. (j+1)*bits - 1 of the stream, its least significant bit first, and stream bit b is
    bit b % 8 (from the least significant) of byte b // 8; the last byte's unused bits are 0."""
    flat = codes.reshape(-1, 1).long()
    stream = ((flat >> torch.arange(bits)) & 1).to(torch.uint8).reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, torch.zeros(pad, dtype=torch.uint8)])
    weights = (1 << torch.arange(8)).to(torch.int32)
    return (stream.reshape(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack(data: torch.Tensor, bits: int, n: int) -> tuple[torch.Tensor, bool]:
    """The n codes `pack` wrote (int64), and whether the padding bits after them are all 0."""
    stream = ((data.reshape(-1, 1).long() >> torch.arange(8)) & 1).reshape(-1)
    used = n * bits
    codes = (stream[:used].reshape(n, bits) << torch.arange(bits)).sum(dim=1)
    return codes, not bool(stream[used:].any())


def _tiles(t: torch.Tensor, lay: Layout, fill: float) -> torch.Tensor:
    """[rows, cols] as [chunks, tile_h x tile_w], edge tiles padded with `fill`."""
    nr, nc = lay.grid
    padded = torch.nn.functional.pad(
        t, (0, nc * lay.tile_w - lay.cols, 0, nr * lay.tile_h - lay.rows), value=fill
    )
    tiles = padded.reshape(nr, lay.tile_h, nc, lay.tile_w).permute(0, 2, 1, 3)
    return tiles.reshape(nr * nc, lay.tile_h * lay.tile_w)


def _levels(bits: int) -> int:
    return 1 << (bits - 1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """sign x scale x (m + 1) / 2^(bits-1) in fp32 (exact: fp16 scales, small integers), the
    code's top bit the sign (1: negative), its other bits m."""
    levels = _levels(bits)
    m = (codes & (levels - 1)).float() + 1.0
    sign = 1.0 - 2.0 * (codes >> (bits - 1)).float()
    return sign * (m * scales.float()) / levels


def sparse_encode(x: torch.Tensor, wire: DeltaWire) -> tuple[Tensors, torch.Tensor]:
    """(the parts scales, values, indices without their NAME prefix, the dense fp32 tensor they
    decode to) for one tensor."""
    shape = tuple(x.shape)
    lay = layout(shape, wire)
    flat2 = x.reshape(lay.rows, lay.cols)
    if lay.chunks == 0:
        empty = torch.zeros(0, dtype=torch.uint8)
        return {
            "scales": torch.zeros(0, dtype=torch.float16),
            "values": empty,
            "indices": empty,
        }, x.clone()
    mags = _tiles(flat2.abs(), lay, -1.0)  # padding never wins a place
    vals = _tiles(flat2, lay, 0.0)
    size = lay.tile_h * lay.tile_w
    ks = torch.tensor(lay.ks)
    kmax = max(lay.ks)
    top = torch.topk(mags, kmax, dim=1, sorted=True).indices
    keep = torch.arange(kmax)[None, :] < ks[:, None]
    # ascending within each chunk; the places a chunk does not use sort after its own
    padded_idx = torch.where(keep, top, torch.full_like(top, size)).sort(dim=1).values
    kept_vals = vals.gather(1, padded_idx.clamp(max=size - 1))[keep]
    padded_idx = padded_idx[keep]
    chunk_of = torch.repeat_interleave(torch.arange(lay.chunks), ks)
    widths = torch.tensor(lay.widths)[chunk_of]
    local = (padded_idx // lay.tile_w) * widths + padded_idx % lay.tile_w
    scale = mags.amax(dim=1).clamp(max=65504.0).to(torch.float16)
    s = scale.float()[chunk_of]
    levels = _levels(wire.bits)
    ratio = torch.where(s > 0, kept_vals.abs() / torch.where(s > 0, s, 1.0), 0.0)
    m = (torch.round(ratio * levels) - 1).clamp_(0, levels - 1).long()
    codes = ((kept_vals < 0).long() << (wire.bits - 1)) | m
    parts = {
        "scales": scale,
        "values": pack(codes, wire.bits),
        "indices": pack(local, wire.index_bits),
    }
    sent = _scatter(lay, chunk_of, local, dequantize(codes, s, wire.bits)).reshape(shape)
    return parts, sent


def _scatter(
    lay: Layout, chunk_of: torch.Tensor, local: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """The dense [rows x cols] fp32 tensor with `values` at chunk-local indices `local`."""
    nc = lay.grid[1]
    widths = torch.tensor(lay.widths)[chunk_of]
    row = (chunk_of // nc) * lay.tile_h + local // widths
    col = (chunk_of % nc) * lay.tile_w + local % widths
    dense = torch.zeros(lay.rows * lay.cols, dtype=torch.float32)
    dense[row * lay.cols + col] = values
    return dense


def sparse_decode(
    name: str,
    scales: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    shape: tuple[int, ...],
    wire: DeltaWire,
) -> torch.Tensor:
    """The dense fp32 tensor of one tensor's sparse parts, whose dtypes and lengths were
    checked (`expected_parts`); WireError bad_scales, bad_indices or malformed otherwise."""
    lay = layout(shape, wire)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WireError("bad_scales", f"{name}: a chunk's scale is NaN, Inf or negative")
    codes, clean = unpack(values, wire.bits, lay.kept)
    if not clean:
        raise WireError("malformed", f"{name}: the value stream's padding bits are not 0")
    local, clean = unpack(indices, wire.index_bits, lay.kept)
    if not clean:
        raise WireError("malformed", f"{name}: the index stream's padding bits are not 0")
    ks = torch.tensor(lay.ks, dtype=torch.long)
    chunk_of = torch.repeat_interleave(torch.arange(lay.chunks), ks)
    sizes = (torch.tensor(lay.heights) * torch.tensor(lay.widths))[chunk_of]
    outside = local >= sizes
    if bool(outside.any()):
        at = int(outside.nonzero()[0])
        raise WireError(
            "bad_indices",
            f"{name}: chunk {int(chunk_of[at])} holds {int(sizes[at])} values, "
            f"not index {int(local[at])}",
        )
    same_chunk = chunk_of[1:] == chunk_of[:-1]
    if bool((same_chunk & (local[1:] <= local[:-1])).any()):
        raise WireError(
            "bad_indices", f"{name}: indices must be unique and ascending within each chunk"
        )
    value = dequantize(codes, scales.float()[chunk_of], wire.bits)
    return _scatter(lay, chunk_of, local, value).reshape(shape)


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
    """The dense delta of parts whose names, dtypes and shapes were checked against
    `expected_parts` (and `check_k`): fp16/bf16 stay as they came (the accumulator sums in
    fp32), int8, top-k and sparse become fp32. WireError bad_scales / bad_indices (sparse: also
    malformed, for padding bits that are not 0) for parts that do not describe one tensor."""
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
