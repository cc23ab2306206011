"""The sparse codec (after SparseLoCo and DeMo): a matrix is cut into CHUNK x CHUNK tiles (a
vector into flat chunks of CHUNK^2), the k = ceil(DENSITY x n) largest magnitudes of each chunk
are kept, each as a sign and a BITS - 1 bit level m: value = sign x scale x (m + 1) /
2^(BITS - 1), scale the chunk's max |x| in fp16. No level is zero, so a kept coordinate decodes
non-zero and the mean of sparse votes can count, per coordinate, the votes that carry it.
`sparse_decode` refuses (WireError) bad scales, padding bits that are not 0 and indices out of
their chunk or not ascending."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.tensorwire import WireError

Tensors = dict[str, torch.Tensor]


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
