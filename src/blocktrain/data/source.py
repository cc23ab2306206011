"""One split's bytes, memory-mapped, and the windows drawn from them. Randomness comes only from
the ``torch.Generator`` a caller passes, so batches are reproducible from a seed and independent
of any global RNG state."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from blocktrain.data.sniff import inflated
from blocktrain.errors import DataError


@dataclass(frozen=True)
class Span:
    """A byte range ``[start, stop)`` of one file's text: the unit a split is made of. For a
    gzip file (``gzip``) the range is of the decompressed text."""

    path: Path
    start: int
    stop: int
    gzip: bool = False

    def __len__(self) -> int:
        return self.stop - self.start


class ByteSource:
    """The bytes of one split, memory-mapped, possibly spread over several files: nothing is copied
    until a batch is built. Windows never cross a file boundary, because the byte after one file's
    end is not the text that follows it."""

    def __init__(self, name: str, spans: Sequence[Span]) -> None:
        self.name = name
        self._spans = [span for span in spans if len(span) > 0]
        self._arrays = _map_spans(self._spans)

    def __getstate__(self) -> dict[str, object]:
        """Send the spans, not the mapped bytes, when a source goes to another process."""
        return {"name": self.name, "spans": self._spans}

    def __setstate__(self, state: dict[str, object]) -> None:
        """Map the files again on the receiving side."""
        self.name = cast(str, state["name"])
        self._spans = cast("list[Span]", state["spans"])
        self._arrays = _map_spans(self._spans)

    @property
    def paths(self) -> list[Path]:
        """Files this split reads from, in order (each at most once)."""
        return list(dict.fromkeys(span.path for span in self._spans))

    def __len__(self) -> int:
        return sum(len(span) for span in self._spans)

    def sha256(self) -> str:
        """The SHA-256 of the split's bytes (files one after another), read in 1 MiB pieces:
        for a WikiText split, the hash of its file."""
        digest = hashlib.sha256()
        for array in self._arrays:
            for start in range(0, len(array), 1 << 20):
                digest.update(array[start : start + (1 << 20)].tobytes())
        return digest.hexdigest()

    def read(self) -> np.ndarray:
        """Every byte of the split, files one after another, as one uint8 array (a copy)."""
        if not self._arrays:
            return np.zeros(0, dtype=np.uint8)
        return np.concatenate([np.asarray(a) for a in self._arrays])

    def __repr__(self) -> str:
        return f"ByteSource(name={self.name!r}, bytes={len(self)}, files={len(self.paths)})"

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """Draw ``batch_size`` random windows of ``seq_len`` bytes (int64, on the CPU): a start
        uniform over all valid starts of all spans, from ``generator`` only, so equal seeds give
        equal batches."""
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        starts = np.array([max(0, len(a) - seq_len + 1) for a in self._arrays], dtype=np.int64)
        total = int(starts.sum())
        if total == 0:
            raise self._too_short(seq_len)
        draws = torch.randint(
            total, (batch_size,), generator=generator, dtype=torch.int64, device=generator.device
        )
        flat = draws.cpu().numpy()
        ends = np.cumsum(starts)
        which = np.searchsorted(ends, flat, side="right")
        offsets = flat - (ends[which] - starts[which])
        out = np.empty((batch_size, seq_len), dtype=np.int64)
        cols = np.arange(seq_len, dtype=np.int64)
        for index in np.unique(which):
            rows = np.flatnonzero(which == index)
            # Fancy indexing reads only these windows' bytes from the map.
            out[rows] = self._arrays[int(index)][offsets[rows, None] + cols]
        return torch.from_numpy(out)

    def windows(self, seq_len: int, n_bytes: int) -> torch.Tensor:
        """``ceil(n_bytes / seq_len)`` consecutive, non-overlapping windows from the start, file by
        file (fewer if the split holds fewer): evaluation needs the same text every time."""
        _check_positive(seq_len=seq_len, n_bytes=n_bytes)
        wanted = math.ceil(n_bytes / seq_len)
        chunks: list[np.ndarray] = []
        for array in self._arrays:
            take = min(len(array) // seq_len, wanted)
            if take > 0:
                chunk = np.asarray(array[: take * seq_len], dtype=np.int64)
                chunks.append(chunk.reshape(take, seq_len))
                wanted -= take
            if wanted == 0:
                break
        if not chunks:
            raise self._too_short(seq_len)
        return torch.from_numpy(np.concatenate(chunks))

    def _too_short(self, seq_len: int) -> DataError:
        """The error for a split no file of which holds one window."""
        files = ", ".join(str(p) for p in self.paths) or "no files"
        return DataError(
            f"the {self.name} split is shorter than seq_len = {seq_len} bytes "
            f"(it holds {len(self)} bytes in {files}; windows do not cross files); "
            "use more text or a smaller seq_len"
        )


def _check_positive(**values: int) -> None:
    """Reject non-positive sizes: they are caller bugs, not data problems."""
    for key, value in values.items():
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")


def _map_spans(spans: Sequence[Span]) -> list[np.ndarray]:
    """Map each file once (read-only; a gzip file's text from memory) and return one view per
    span."""
    maps: dict[Path, np.ndarray] = {}
    views: list[np.ndarray] = []
    for span in spans:
        if span.path not in maps:
            if span.gzip:
                maps[span.path] = inflated(span.path)
            else:
                try:
                    maps[span.path] = np.memmap(span.path, dtype=np.uint8, mode="r")
                except (OSError, ValueError) as exc:
                    raise DataError(f"cannot read {span.path}: {exc}") from exc
        views.append(maps[span.path][span.start : span.stop])
    return views
