"""A relayed stream (`route = relay`, docs/model.md): what block b's replica computed in its local
steps of one round, for the worker of block b+1 to train on without holding blocks 0..b.

One safetensors body, read only through `tensorwire`:

    bytes      U8  (S, N, T)     the sequences of its S local steps, N of T bytes each
    features   I8  (S, N, T, d)  block b's clean-stream output on them, per token absmax
    scales     F32 (S, N, T)     ... int8 with this scale: features ~= int8 * scale

with string metadata `format`, `block`, `round` and `worker`. 8-bit activations are what SWARM
relays between its stages; a scale per token because the residual stream's tokens differ in
scale (an fp16 scale loses small tokens below 2^-14). At `bits` 4 or 2 (metadata `bits` and
`d_model`; the run's `relay_bits`) a token is first rotated (`rotate`: fixed random signs, then
a Walsh-Hadamard transform over chunks of the largest power of two that divides d), which
spreads the residual stream's outlier features over the token so its values are near Gaussian;
each value is then one of 2^bits evenly spaced levels (k + 1/2) * scale, k in -2^(bits-1) ..
2^(bits-1) - 1, scale = STEP[bits] * the token's RMS (the best uniform step for a Gaussian),
stored as k + 2^(bits-1), 8 / bits of them a byte, the first in the low bits: features U8
(S, N, T, ceil(d bits / 8)). On a trained model's streams that errs far less than absmax levels
without the rotation, the codec of `blocktrain-relay-1`, whose 8-bit streams read the same
(`bench/relay_probe.py --codec-error`, docs/research/compose.md). The writer spools a round one
step at a time to a folder or keeps it in memory; the reader reads one step at a time."""

from __future__ import annotations

import functools
import io
import json
import math
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from blocktrain.tensorwire import Body, WireError, decode

FORMAT = "blocktrain-relay-2"
READABLE_FORMATS = {FORMAT: (2, 4, 8), "blocktrain-relay-1": (8,)}
"""The formats a reader takes, with their bits: relay-1's packed codes were absmax levels."""
NAMES = ("bytes", "features", "scales")
DTYPES = {"bytes": ("U8", torch.uint8), "features": ("I8", torch.int8), "scales": ("F32", torch.float32)}  # fmt: skip
BYTES_PER_TOKEN_OVER_D = 5
"""A token costs its features and 5 bytes more: its byte id and an fp32 scale."""


def feature_width(d_model: int, bits: int = 8) -> int:
    """The bytes of one token's features at `bits` a value."""
    return -(-d_model * bits // 8)


def bytes_per_step(batch: int, seq_len: int, d_model: int, bits: int = 8) -> int:
    """The bytes one local step's batch adds to a stream (headers aside)."""
    return batch * seq_len * (feature_width(d_model, bits) + BYTES_PER_TOKEN_OVER_D)


def relayed_steps(local_steps: int, every: int) -> int:
    """The steps a round's stream holds when one local step in `every` is relayed (0, every,
    2 every, ...)."""
    return -(-local_steps // every)


STEP = {2: 0.9957, 4: 0.3352}
"""The step of the uniform quantiser with 2^bits levels that has the least squared error on a
unit Gaussian (Max 1960), times the token's RMS: a packed stream's scale."""

_SIGNS_SEED = 0x5EED_2E1A
"""The seed of the rotation's signs: one fixed rotation, so sender and reader agree with no key."""


@functools.cache
def _signs(d: int) -> torch.Tensor:
    """The rotation's d signs, drawn once per width (every relayed step uses them twice)."""
    gen = torch.Generator().manual_seed(_SIGNS_SEED)
    return torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1


def _hadamard(u: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of u (..., d) over chunks of p, the largest power
    of two that divides d; it is its own inverse."""
    d = u.shape[-1]
    p = d & -d
    x = u.reshape(-1, p)
    h = 1
    while h < p:
        x = x.view(-1, p // (2 * h), 2, h)
        x = torch.stack((x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]), dim=2)
        h *= 2
    return x.reshape(u.shape) / math.sqrt(p)


def rotate(u: torch.Tensor) -> torch.Tensor:
    """u (..., d) -> the same tokens in the packed codes' basis (orthonormal; `unrotate` undoes)."""
    return _hadamard(u * _signs(u.shape[-1]))


def unrotate(v: torch.Tensor) -> torch.Tensor:
    return _hadamard(v) * _signs(v.shape[-1])


def quantise(u: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """u (..., d) float -> (codes, fp32 scales (...)): int8 (..., d) levels over the token's
    absmax at 8 bits; else the rotated token's levels, packed uint8 (..., feature_width(d, bits))."""
    u = u.detach().float()
    if bits == 8:
        scale = u.abs().amax(dim=-1) / 127
        q = torch.round(u / scale.clamp(min=1e-30)[..., None]).clamp(-127, 127)
        return q.to(torch.int8), scale
    half = 1 << (bits - 1)
    v = rotate(u)
    scale = STEP[bits] * v.pow(2).mean(dim=-1).sqrt()
    k = torch.floor(v / scale.clamp(min=1e-30)[..., None]).clamp(-half, half - 1)
    codes = (k + half).to(torch.uint8)
    per = 8 // bits
    pad = -codes.shape[-1] % per
    codes = torch.nn.functional.pad(codes, (0, pad)).reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (codes << shifts).sum(dim=-1, dtype=torch.uint8), scale


def dequantise(
    q: torch.Tensor, scale: torch.Tensor, bits: int = 8, d: int | None = None
) -> torch.Tensor:
    """(codes, fp32 (...)) -> float32 (..., d); `d` the features a token has (packed codes)."""
    if bits == 8:
        return q.float() * scale.float()[..., None]
    if d is None:
        raise ValueError("packed codes need the features a token has (d)")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    codes = (q[..., None] >> shifts) & ((1 << bits) - 1)
    k = codes.reshape(*q.shape[:-1], -1)[..., :d].float() - (1 << (bits - 1)) + 0.5
    return unrotate(k * scale.float()[..., None])


@dataclass(frozen=True)
class Shape:
    """What every step of a stream holds: N sequences of T bytes, d features a token."""

    batch: int
    seq_len: int
    d_model: int
    bits: int = 8

    def tensor_shape(self, name: str, steps: int) -> tuple[int, ...]:
        base = (steps, self.batch, self.seq_len)
        return (*base, feature_width(self.d_model, self.bits)) if name == "features" else base

    def dtype(self, name: str) -> tuple[str, torch.dtype]:
        return ("U8", torch.uint8) if name == "features" and self.bits != 8 else DTYPES[name]


class StreamWriter:
    """Builds one round's stream, step by step (`add`), then `finish` it into a `StreamBody`."""

    def __init__(self, shape: Shape, spool: Path | None = None) -> None:
        """`spool`: a folder for the round's parts (one step in memory at a time), else memory."""
        self.shape = shape
        self.steps = 0
        self._paths: list[Path] = []
        if spool is None:
            self._parts: list[BinaryIO] = [io.BytesIO() for _ in NAMES]
        else:
            spool.mkdir(parents=True, exist_ok=True)
            self._paths = [spool / f"out.{name}.part" for name in NAMES]
            self._parts = [open(p, "w+b") for p in self._paths]  # noqa: SIM115 (closed in finish)

    def add(self, x_bytes: torch.Tensor, features: torch.Tensor) -> None:
        """One local step: x_bytes (N, T) ints in 0..255, features (N, T, d)."""
        s = self.shape
        if tuple(x_bytes.shape) != (s.batch, s.seq_len) or tuple(features.shape) != (
            s.batch,
            s.seq_len,
            s.d_model,
        ):
            raise ValueError(
                f"a relayed step is ({s.batch}, {s.seq_len}) bytes with (..., {s.d_model}) "
                f"features, not {tuple(x_bytes.shape)} and {tuple(features.shape)}"
            )
        q, scale = quantise(features, s.bits)
        for part, t in zip(self._parts, (x_bytes.to(torch.uint8), q, scale), strict=True):
            part.write(t.cpu().contiguous().numpy().tobytes())
        self.steps += 1

    def finish(self, metadata: dict[str, str]) -> StreamBody:
        """The stream of the steps added so far, with `metadata` (strings) beside the format."""
        if self.steps == 0:
            raise ValueError("a stream holds at least one step")
        offsets: dict[str, list[int]] = {}
        start = 0
        for name in NAMES:
            shape = self.shape.tensor_shape(name, self.steps)
            size = math.prod(shape) * self.shape.dtype(name)[1].itemsize
            offsets[name] = [start, start + size]
            start += size
        packed = {} if self.shape.bits == 8 else {"bits": str(self.shape.bits), "d_model": str(self.shape.d_model)}  # fmt: skip
        header = {
            "__metadata__": {"format": FORMAT, **metadata, **packed},
            **{
                name: {
                    "dtype": self.shape.dtype(name)[0],
                    "shape": list(self.shape.tensor_shape(name, self.steps)),
                    "data_offsets": offsets[name],
                }
                for name in NAMES
            },
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
        for part in self._parts:
            part.flush()
            part.seek(0)
        return StreamBody(struct.pack("<Q", len(raw)) + raw, self._parts, start)


class StreamBody:
    """A finished stream: its bytes as one `bytes` (`read`) or in chunks (`chunks`, for an
    upload that never holds the whole round)."""

    def __init__(self, head: bytes, parts: list[BinaryIO], data_bytes: int) -> None:
        self._head = head
        self._parts = parts
        self.size = len(head) + data_bytes

    def chunks(self, chunk: int = 1 << 20) -> Iterator[bytes]:
        yield self._head
        for part in self._parts:
            part.seek(0)
            while block := part.read(chunk):
                yield block

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def close(self) -> None:
        for part in self._parts:
            part.close()


@dataclass(frozen=True)
class StreamInfo:
    """A stream's header, checked: its shape, steps and metadata."""

    shape: Shape
    steps: int
    metadata: dict[str, str]
    offsets: dict[str, tuple[int, int]]
    """Each tensor's byte range, from the start of the body."""


def check(body: Body, shape: Shape | None = None, *, max_bytes: int | None = None) -> StreamInfo:
    """Read a stream's header and check it: the three tensors and nothing else, their dtypes,
    one S, N, T and d across them (`shape` when given), finite scales. A WireError (reason
    `malformed`, `bad_dtype`, `bad_shape`, `non_finite`, ...) says what is wrong."""
    decoded = decode(body, max_bytes=max_bytes)
    meta = decoded.metadata
    if meta.get("format") not in READABLE_FORMATS:
        raise WireError("malformed", f"not a relayed stream (format {meta.get('format')!r})")
    if sorted(decoded.tensors) != sorted(NAMES):
        raise WireError(
            "malformed", f"a stream holds {', '.join(NAMES)}, not {sorted(decoded.tensors)}"
        )
    feats = decoded.tensors["features"].shape
    if len(feats) != 4 or not all(v > 0 for v in feats):
        raise WireError("bad_shape", f"features must be (S, N, T, d), not {feats}")
    try:
        bits = int(meta.get("bits", "8"))
        d = int(meta["d_model"]) if bits != 8 else feats[3]
    except (KeyError, ValueError):
        raise WireError("malformed", "a packed stream names its bits and d_model") from None
    if d <= 0 or bits not in READABLE_FORMATS[meta["format"]]:
        allowed = " or ".join(map(str, READABLE_FORMATS[meta["format"]][::-1]))
        raise WireError(
            "malformed", f"a {meta['format']} stream's features take {allowed} bits, not {bits}"
        )
    got = Shape(feats[1], feats[2], d, bits)
    for name in NAMES:
        if decoded.tensors[name].dtype != got.dtype(name)[0]:
            raise WireError(
                "bad_dtype",
                f"{name} must be {got.dtype(name)[0]}, not {decoded.tensors[name].dtype}",
            )
    if shape is not None and got != shape:
        raise WireError(
            "bad_shape",
            f"this run relays (N, T, d, bits) = ({shape.batch}, {shape.seq_len}, {shape.d_model}, "
            f"{shape.bits}), not ({got.batch}, {got.seq_len}, {got.d_model}, {got.bits})",
        )
    steps = feats[0]
    for name in NAMES:
        if decoded.tensors[name].shape != got.tensor_shape(name, steps):
            raise WireError("bad_shape", f"{name} must be {got.tensor_shape(name, steps)}")
    if not bool(torch.isfinite(decoded.tensors["scales"].to_torch()).all()):
        raise WireError("non_finite", "the stream's scales hold NaN or infinity")
    view = memoryview(body).cast("B")
    (n,) = struct.unpack("<Q", view[:8])
    header = json.loads(view[8 : 8 + n].tobytes())  # checked by decode above
    offsets = {name: (8 + n + header[name]["data_offsets"][0], 8 + n + header[name]["data_offsets"][1]) for name in NAMES}  # fmt: skip
    return StreamInfo(got, steps, meta, offsets)


class RelayStream:
    """A checked stream, read one step at a time (`step`), from a body or a file."""

    def __init__(self, info: StreamInfo, source: Body | Path) -> None:
        self.info = info
        self._source = source

    @classmethod
    def from_body(cls, body: Body, shape: Shape | None = None) -> RelayStream:
        return cls(check(body, shape), body)

    @classmethod
    def from_file(cls, path: Path, shape: Shape | None = None) -> RelayStream:
        """A stream saved to `path`, checked through a memory map (only its header and scales
        are read), then read a step at a time."""
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                info = check(view, shape)
            finally:
                view.release()
        return cls(info, Path(path))

    @property
    def steps(self) -> int:
        return self.info.steps

    @property
    def metadata(self) -> dict[str, str]:
        return self.info.metadata

    def step(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `index` (wrapping around S): (bytes (N, T) int64, features (N, T, d) float32)."""
        index %= self.steps
        s = self.info.shape
        out = []
        for name in NAMES:
            begin, end = self.info.offsets[name]
            size = (end - begin) // self.steps
            raw = self._read(begin + index * size, size)
            dtype = s.dtype(name)[1]
            out.append(
                torch.frombuffer(bytearray(raw), dtype=dtype).reshape(s.tensor_shape(name, 1)[1:])
            )
        x, q, scale = out
        return x.long(), dequantise(q, scale, s.bits, s.d_model)

    def _read(self, start: int, size: int) -> bytes:
        if isinstance(self._source, Path):
            with open(self._source, "rb") as f:
                f.seek(start)
                return f.read(size)
        return memoryview(self._source)[start : start + size].tobytes()
