"""The names of the delta codecs, as the settings `delta_wire` (flag `--wire`) and `pull_wire`
give them: parsed and checked (`DeltaWire.parse`), written back (`str`), and what a body in each
declares (`DeltaWire.tag`). How each codec lays out its tensors is `codecs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

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
    def selects(self) -> bool:
        """Sends a selection of the coordinates (top-k), the rest kept in the worker's residual
        for later rounds."""
        return self.kind in ("topk", "sparse")

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


SPARSE_PULL_DENSITY = 2
"""A sparse push codec's default pulls keep this many times its density. A version's delta is
the mean of every replica's sparse votes, so its support is up to that many times one vote's
(two replicas a block at the tiny preset); pulled at the push density, what a pull leaves out
is a lag (in the views, or under exact pulls in the aggregator's remainder) that each worker
trains in again (docs/protocol.md, Compressed pulls; the measurements are BENCHMARKS.md's,
Compressed deltas)."""
SPARSE_PULL_BITS = 4


def default_pulls(push: DeltaWire) -> str:
    """The pull wire when `pull_wire` is not set: full for a dense push codec; for sparse, its
    chunks at SPARSE_PULL_DENSITY times the density (at most 0.5) and at least SPARSE_PULL_BITS
    bits; else the push codec itself."""
    if push.dense:
        return FULL
    if push.sparse:
        density = round(min(0.5, SPARSE_PULL_DENSITY * push.ratio), 6)
        bits = max(SPARSE_PULL_BITS, push.bits)
        return str(DeltaWire("sparse", density, bits, push.chunk))
    return str(push)


def valid_pull_wire(text: object) -> bool:
    try:
        pull_codec(str(text))
    except ValueError:
        return False
    return True
