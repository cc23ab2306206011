"""Byte-level corpora: find the text, split it, and draw windows of bytes from it.

The model's vocabulary is the 256 byte values, so a corpus is just bytes. Files are memory-mapped
(read-only) rather than read, so that a corpus larger than memory costs nothing to open and every
batch copies only the bytes it uses. Three layouts are understood:

- a WikiText folder (any of ``wiki.train.raw``, ``wiki.valid.raw``, ``wiki.test.raw``): each file
  is its split;
- any other text file: the first 90% is ``train``, the next 5% ``valid``, the last 5% ``test``;
- any other folder: every non-hidden regular file in it, split 90/5/5 like a single file, so that
  every split draws from every file.

Randomness comes only from the ``torch.Generator`` a caller passes, so batches are reproducible
from a seed and independent of any global RNG state.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import numpy as np
import torch

from blocktrain.errors import DataError

logger = logging.getLogger(__name__)

DATA_ENV = "BLOCKTRAIN_DATA"
"""Environment variable naming the corpus when no ``--data`` flag is given."""

SPLITS: tuple[str, ...] = ("train", "valid", "test")
"""The split names every corpus answers to."""

WIKITEXT_FILES: dict[str, str] = {
    "train": "wiki.train.raw",
    "valid": "wiki.valid.raw",
    "test": "wiki.test.raw",
}
"""File of each split in a WikiText folder; the presence of any one marks the layout."""

SPLIT_FRACTIONS: tuple[float, float] = (0.90, 0.95)
"""Ends of train and of valid, as fractions of a file, for the position split."""

SNIFF_BYTES = 64 * 1024
"""How much of each file is checked for text at open: enough to catch binaries, cheap for huge
corpora."""

TEXT_HINT = "BlockTrain reads UTF-8 text"

TextKind = Literal["text", "empty", "binary"]


@dataclass(frozen=True)
class Span:
    """A byte range ``[start, stop)`` of one file: the unit a split is made of."""

    path: Path
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def resolve_data_path(path: str | os.PathLike[str] | None) -> Path:
    """Return the corpus path from the flag, else from ``BLOCKTRAIN_DATA``.

    The flag wins so that one run can point elsewhere without touching the environment. An empty
    value counts as not given, so ``BLOCKTRAIN_DATA=`` does not silently mean the current folder.
    """
    value: str | os.PathLike[str] | None = path if path not in (None, "") else None
    if value is None:
        value = os.environ.get(DATA_ENV) or None
    if value is None:
        raise DataError(
            f"no data given: pass --data PATH or set {DATA_ENV}=PATH (a WikiText raw folder, "
            "a text file or a folder of text files; there is no default corpus), e.g. after "
            "`blocktrain data fetch wikitext-2 --to data/wikitext-2`"
        )
    resolved = Path(value).expanduser()
    if not resolved.exists():
        raise DataError(f"data path {resolved} does not exist; pass --data PATH or set {DATA_ENV}")
    return resolved


class ByteSource:
    """The bytes of one split, memory-mapped, possibly spread over several files.

    Each file is mapped once and each span is a view of that map, so nothing is copied until a
    batch is built, and then only the bytes of its windows. Windows never cross a file boundary,
    because the byte after one file's end is not the text that follows it.
    """

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
        """Draw ``batch_size`` random windows of ``seq_len`` bytes, as an int64 tensor.

        A start is drawn uniformly over all valid starts of all spans, which is the same as
        picking a span in proportion to its valid starts and then a start inside it. Only
        ``generator`` is used, so equal seeds give equal batches. The batch is on the CPU whatever
        the generator's device; the caller moves it.
        """
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
        """Return ``ceil(n_bytes / seq_len)`` consecutive, non-overlapping windows from the start.

        Evaluation needs the same text every time, so this is deterministic: windows are taken
        file by file from each span's start, and fewer are returned if the split holds fewer.
        """
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


class ByteCorpus:
    """A corpus on disk and its train/valid/test splits, validated once at open."""

    def __init__(
        self,
        root: Path,
        layout: str,
        splits: dict[str, list[Span]],
        missing: dict[str, Path] | None = None,
    ) -> None:
        self.root = root
        self.layout = layout
        """``"wikitext"``, ``"file"`` or ``"folder"``."""
        self._splits = splits
        self._missing = missing or {}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ByteCorpus:
        """Open a WikiText folder, a text file or a folder of text files.

        Only the first 64 KiB of each file is read here, so opening is cheap for any corpus size;
        empty and binary inputs fail now rather than deep inside training.
        """
        root = Path(path).expanduser()
        if not root.exists():
            raise DataError(f"data path {root} does not exist")
        if root.is_file():
            _check_text(root)
            corpus = cls(root, "file", _position_split([root]))
        elif not root.is_dir():
            raise DataError(f"data path {root} is neither a file nor a folder")
        elif any((root / name).is_file() for name in WIKITEXT_FILES.values()):
            corpus = cls._open_wikitext(root)
        else:
            corpus = cls(root, "folder", _position_split(_text_files(root)))
        logger.info("opened %s as a %s corpus", root, corpus.layout)
        return corpus

    @classmethod
    def _open_wikitext(cls, root: Path) -> ByteCorpus:
        """Each present ``wiki.*.raw`` is its split; absent ones fail only when asked for."""
        splits: dict[str, list[Span]] = {}
        missing: dict[str, Path] = {}
        for split, name in WIKITEXT_FILES.items():
            file = root / name
            if file.is_file():
                size = _check_text(file)
                splits[split] = [Span(file, 0, size)]
            else:
                missing[split] = file
        return cls(root, "wikitext", splits, missing)

    def split(self, name: str) -> ByteSource:
        """Return one split, memory-mapped."""
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)}")
        if name in self._missing:
            raise DataError(
                f"the {name} split is missing: {self._missing[name].name} is not in {self.root} "
                f"(that folder holds a WikiText layout: wiki.train.raw, wiki.valid.raw, "
                f"wiki.test.raw); add the file or point --data at another corpus"
            )
        return ByteSource(name, self._splits[name])

    def describe(self) -> dict[str, dict[str, object]]:
        """Per available split: its size in bytes and the files it reads, for logs and run info."""
        return {
            name: {
                "bytes": sum(len(span) for span in spans),
                "files": [str(p) for p in dict.fromkeys(span.path for span in spans)],
            }
            for name, spans in self._splits.items()
        }

    def __repr__(self) -> str:
        return f"ByteCorpus(root={str(self.root)!r}, layout={self.layout!r})"


def load_split(path: str | os.PathLike[str] | None, split: str) -> ByteSource:
    """Resolve the data path (flag, then env var), open it and return one split."""
    return ByteCorpus.open(resolve_data_path(path)).split(split)


def _check_positive(**values: int) -> None:
    """Reject non-positive sizes: they are caller bugs, not data problems."""
    for key, value in values.items():
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")


def _map_spans(spans: Sequence[Span]) -> list[np.ndarray]:
    """Map each file once (read-only) and return one view per span."""
    maps: dict[Path, np.ndarray] = {}
    views: list[np.ndarray] = []
    for span in spans:
        if span.path not in maps:
            try:
                maps[span.path] = np.memmap(span.path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as exc:
                raise DataError(f"cannot read {span.path}: {exc}") from exc
        views.append(maps[span.path][span.start : span.stop])
    return views


def _position_split(files: Sequence[Path]) -> dict[str, list[Span]]:
    """Cut every file at 90% and 95% of its length into train, valid and test spans."""
    splits: dict[str, list[Span]] = {name: [] for name in SPLITS}
    for file in files:
        size = file.stat().st_size
        cut_train = int(size * SPLIT_FRACTIONS[0])
        cut_valid = int(size * SPLIT_FRACTIONS[1])
        splits["train"].append(Span(file, 0, cut_train))
        splits["valid"].append(Span(file, cut_train, cut_valid))
        splits["test"].append(Span(file, cut_valid, size))
    return splits


def _text_files(root: Path) -> list[Path]:
    """Every usable text file under ``root``; empty and binary ones are skipped with a warning.

    A folder with no usable file at all is one error that says why, not a warning per file.
    """
    candidates = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    usable: list[Path] = []
    binary: list[Path] = []
    for file in candidates:
        kind = _sniff(file)
        if kind == "text":
            usable.append(file)
        else:
            logger.warning("skipping %s: %s", file, "empty" if kind == "empty" else "not text")
            if kind == "binary":
                binary.append(file)
    if usable:
        return usable
    if binary:
        raise DataError(
            f"folder {root} does not look like text (binary data): none of its files is text "
            f"(e.g. {binary[0].name}); {TEXT_HINT}"
        )
    raise DataError(f"folder {root} is empty: it holds no non-empty files")


def _check_text(file: Path) -> int:
    """Fail unless ``file`` is a non-empty text file; return its size."""
    kind = _sniff(file)
    if kind == "empty":
        raise DataError(f"{file} is empty")
    if kind == "binary":
        raise DataError(f"{file} does not look like text (binary data); {TEXT_HINT}")
    return file.stat().st_size


def _sniff(file: Path) -> TextKind:
    """Classify ``file`` as ``"text"``, ``"empty"`` or ``"binary"`` from its first 64 KiB.

    A NUL byte or invalid UTF-8 marks binary data. The decoder is not told the sample is final, so
    a multi-byte character cut by the sample's end (at most 3 bytes) is not an error.
    """
    try:
        with file.open("rb") as handle:
            sample = handle.read(SNIFF_BYTES)
    except OSError as exc:
        raise DataError(f"cannot read {file}: {exc}") from exc
    if not sample:
        return "empty"
    if b"\x00" in sample:
        return "binary"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
    except UnicodeDecodeError:
        return "binary"
    return "text"
