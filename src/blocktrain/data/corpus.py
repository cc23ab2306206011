"""Byte-level corpora: find the text, split it, and draw windows of bytes from it.

The model's vocabulary is the 256 byte values, so a corpus is just bytes. Files are memory-mapped
(read-only) rather than read, so that a corpus larger than memory costs nothing to open and every
batch copies only the bytes it uses. Three layouts are understood:

- a WikiText folder (any of ``wiki.train.raw``, ``wiki.valid.raw``, ``wiki.test.raw`` at its top):
  each file is its split, and the folder's other files are not read;
- any other text file: the first 90% is ``train``, the next 5% ``valid``, the last 5% ``test``;
- any other folder: every non-hidden regular file under it, subfolders included, split 90/5/5
  like a single file, so that every split draws from every file;
- ``hf:NAME[:CONFIG]`` or ``hf:PATH``: a Hugging Face ``datasets`` dataset, its text column
  written once into a cache folder and read from there (``data/hf.py``).

What a file holds is judged from its first 64 KiB:

- UTF-8 text is read as it is;
- text in another 8-bit encoding (Latin-1, Windows-1252, ...: not UTF-8, but without NUL bytes
  or more than 1% control bytes) is read as its bytes, the model being byte-level, with one
  warning line that names the files: convert them first (``iconv -f latin1 -t utf-8``) to train
  on UTF-8;
- gzip-compressed files (by their magic bytes) are decompressed into memory, at most
  ``GZIP_MAX_BYTES`` of text per corpus (a gzip bomb is an error, not an out-of-memory kill),
  and then judged as above;
- empty files, binary data, UTF-16/32 text, archives and other compressed formats are refused
  for a single file, with a message naming what the file is, and skipped in a folder, all the
  skipped files summed up in one warning line (``skipped 3 files: 2 not text, 1 empty (first:
  a.bin, b.png, c.txt)``).

In a folder, ``FilePatterns`` (``--include`` / ``--exclude`` on the command line) choose the
files; hidden files and folders (a name starting with ``.``) are never read.

Randomness comes only from the ``torch.Generator`` a caller passes, so batches are reproducible
from a seed and independent of any global RNG state.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import logging
import math
import os
import re
import shlex
import weakref
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch

from blocktrain.data.hf import SPLIT_NAMES as HF_SPLIT_NAMES
from blocktrain.data.hf import HfSource, is_hf, materialise, saved_by_datasets
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

CONTROL_SHARE = 0.01
"""Above this share of control bytes (other than tab, newlines, form feed and escape), a file
that is not UTF-8 is binary data rather than text in an 8-bit encoding."""

GZIP_MAX_BYTES = 1 << 30
"""Most text (decompressed) that one corpus reads from .gz files: it is held in memory, not
mapped, so a gzip bomb stops here with a clear error."""


def gzip_cap() -> str:
    """GZIP_MAX_BYTES in words: "1 GiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if 1 << shift <= GZIP_MAX_BYTES:
            return f"{GZIP_MAX_BYTES / (1 << shift):g} {unit}"
    return f"{GZIP_MAX_BYTES} bytes"


TEXT_HINT = (
    "BlockTrain reads UTF-8 text, text in another 8-bit encoding (as its bytes) and "
    "gzip-compressed text"
)

SHOWN = 3
"""File names a summary line shows."""

TextKind = Literal["text", "8bit", "empty", "binary", "utf16", "compressed", "archive", "badgzip"]

_CONTROLS = bytes(b for b in range(32) if b not in b"\t\n\v\f\r\x1b") + b"\x7f"

_MAGIC: tuple[tuple[bytes, TextKind, str], ...] = (
    (b"\xfd7zXZ\x00", "compressed", "xz-compressed (unpack it: `unxz FILE`)"),
    (b"\x28\xb5\x2f\xfd", "compressed", "zstd-compressed (unpack it: `unzstd FILE`)"),
    (b"7z\xbc\xaf\x27\x1c", "archive", "a 7-Zip archive (unpack it: `7z x FILE`)"),
    (b"PK\x03\x04", "archive", "a zip archive (unpack it: `unzip FILE`)"),
)

_REASONS: dict[TextKind, str] = {
    "empty": "empty",
    "binary": "not text",
    "utf16": "UTF-16/32 text",
    "compressed": "compressed",
    "archive": "archives",
    "badgzip": "bad gzip",
}
"""How the one summary line counts the files of each kind a folder skips."""


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


@dataclass(frozen=True)
class Probe:
    """What a file holds, judged at open: its kind, the size of its text (decompressed for a
    gzip file) and, for a file that cannot be read, what it is, in words."""

    kind: TextKind
    size: int = 0
    gzip: bool = False
    what: str = ""

    @property
    def usable(self) -> bool:
        return self.kind in ("text", "8bit")


@dataclass(frozen=True)
class FilePatterns:
    """Which files of a corpus folder are read: those that match an ``include`` pattern (all,
    when there is none) and no ``exclude`` pattern. Patterns are globs on the file's path
    relative to the folder, with ``/`` between folders: one without ``/`` matches a file's name
    at any depth (``*.txt``), one with ``/`` the whole path from the folder (``src/*.py``, and a
    leading ``/`` is the same); ``*`` and ``?`` stay within a folder's name, ``**`` spans any
    number of folders (``build/**``, ``**/test_*.py``), ``[abc]`` is a set, and a trailing ``/``
    means everything under that folder."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    _compiled: tuple[tuple[re.Pattern[str], ...], tuple[re.Pattern[str], ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for flag, patterns in (("--include", self.include), ("--exclude", self.exclude)):
            for pattern in patterns:
                if not pattern.strip():
                    raise DataError(f"{flag} takes a non-empty glob pattern, e.g. '*.txt'")
        compiled = (
            tuple(_glob_regex(p) for p in self.include),
            tuple(_glob_regex(p) for p in self.exclude),
        )
        object.__setattr__(self, "_compiled", compiled)

    def __bool__(self) -> bool:
        return bool(self.include or self.exclude)

    def selects(self, relative: str) -> bool:
        """Whether the file at `relative` (a POSIX path from the folder) is read."""
        include, exclude = self._compiled
        if include and not any(_matches(r, relative) for r in include):
            return False
        return not any(_matches(r, relative) for r in exclude)

    def argv(self) -> list[str]:
        """The command-line flags that give these patterns, for a child command."""
        return [a for p in self.include for a in ("--include", p)] + [
            a for p in self.exclude for a in ("--exclude", p)
        ]

    def flags(self) -> str:
        """The flags as a user would type them (shell-quoted)."""
        return " ".join(shlex.quote(a) if i % 2 else a for i, a in enumerate(self.argv()))


NO_PATTERNS = FilePatterns()


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A FilePatterns glob as a regular expression; a pattern without ``/`` matches a name."""
    pattern = pattern.strip()
    if pattern.endswith("/"):
        pattern += "**"
    anchored = "/" in pattern
    parts = pattern.lstrip("/").split("/")
    out = "" if anchored else "(?:.*/)?"
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out += ".*" if last else "(?:[^/]+/)*"
        else:
            out += _segment_regex(part) + ("" if last else "/")
    return re.compile(out, re.DOTALL)


def _segment_regex(part: str) -> str:
    """One folder or file name of a glob: ``*``, ``?`` and ``[...]`` never cross a ``/``."""
    out, i = "", 0
    while i < len(part):
        c = part[i]
        i += 1
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = part.find("]", i + 1 if i < len(part) and part[i] in "!^" else i)
            if end < 0:
                out += re.escape(c)
                continue
            body = part[i:end]
            i = end + 1
            negate = body[:1] in ("!", "^")
            body = body[1:] if negate else body
            out += "[" + ("^/" if negate else "") + body.replace("\\", "\\\\") + "]"
        else:
            out += re.escape(c)
    return out


def _matches(regex: re.Pattern[str], relative: str) -> bool:
    return regex.fullmatch(relative) is not None


DataPath = str | os.PathLike[str] | HfSource
"""What --data gives: a path, or a Hugging Face dataset (``hf:NAME``, or an HfSource)."""


def resolve_data_path(path: DataPath | None) -> Path | HfSource:
    """Return the corpus path from the flag, else from ``BLOCKTRAIN_DATA``: a Path, or for
    ``hf:...`` the HfSource (``str()`` of it is the spec again, for a child command).

    The flag wins so that one run can point elsewhere without touching the environment. An empty
    value counts as not given, so ``BLOCKTRAIN_DATA=`` does not silently mean the current folder.
    """
    if isinstance(path, HfSource):
        return path
    value: str | os.PathLike[str] | None = path if path not in (None, "") else None
    if value is None:
        value = os.environ.get(DATA_ENV) or None
    if value is None:
        raise DataError(
            f"no data given: pass --data PATH or set {DATA_ENV}=PATH (a WikiText raw folder, "
            "a text file or a folder of text files, or hf:NAME for a Hugging Face dataset; "
            "there is no default corpus), e.g. after `blocktrain data fetch wikitext-2 --to "
            "data/wikitext-2`"
        )
    if is_hf(value):
        source = HfSource.parse(str(value))
        source.check()
        return source
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
        *,
        patterns: FilePatterns = NO_PATTERNS,
        skipped: dict[str, list[str]] | None = None,
        not_utf8: list[str] | None = None,
        excluded: int = 0,
        held: list[np.ndarray] | None = None,
        dataset: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> None:
        self.root = root
        self.layout = layout
        """``"wikitext"``, ``"file"``, ``"folder"`` or ``"hf"``."""
        self.source = source or str(root.resolve())
        """What --data named: the absolute path, or the ``hf:...`` spec."""
        self.dataset = dataset
        """For a Hugging Face dataset: its name, config, text field, splits and fingerprints
        (data/hf.py), as data.json records them."""
        self.patterns = patterns
        self.skipped = skipped or {}
        """Files of a folder that are not read, by reason (paths relative to the folder)."""
        self.not_utf8 = not_utf8 or []
        """Files read as their bytes though they are not UTF-8 (8-bit text)."""
        self.excluded = excluded
        """Files of a folder that the patterns leave out."""
        self._splits = splits
        self._missing = missing or {}
        self._held = held or []
        """The decompressed text of its gzip files, held while the corpus is, so that its
        splits map it from the cache instead of decompressing it again."""

    @classmethod
    def open(cls, path: DataPath, patterns: FilePatterns | None = None) -> ByteCorpus:
        """Open a WikiText folder, a text file, a folder of text files or a Hugging Face
        dataset (``hf:...``); `patterns` choose the files of a folder.

        Only the first 64 KiB of each file is read here (all of a gzip file's text, which is
        held in memory), so opening is cheap for any corpus size; empty and binary inputs fail
        now rather than deep inside training.
        """
        patterns = patterns or NO_PATTERNS
        if is_hf(path):
            source = path if isinstance(path, HfSource) else HfSource.parse(str(path))
            return cls._open_hf(source, patterns)
        assert not isinstance(path, HfSource)
        root = Path(path).expanduser()
        if not root.exists():
            raise DataError(f"data path {root} does not exist")
        if root.is_file():
            if patterns:
                raise DataError(
                    f"{patterns.flags()} choose files of a folder, and {root} is a file; "
                    "drop them or point --data at the folder"
                )
            budget = _GzipBudget()
            probe = _check_text(root, budget)
            not_utf8 = [root.name] if probe.kind == "8bit" else []
            _report(root, patterns, {}, not_utf8)
            corpus = cls(
                root,
                "file",
                _position_split([(root, probe)]),
                not_utf8=not_utf8,
                held=budget.held,
            )
        elif not root.is_dir():
            raise DataError(f"data path {root} is neither a file nor a folder")
        elif saved_by_datasets(root):
            raise DataError(
                f"{root} is a dataset saved by Hugging Face datasets (save_to_disk), not a "
                f"folder of text: pass --data hf:{root} (and --text-field FIELD for a column "
                "other than text)"
            )
        elif any(
            (root / name).is_file() and patterns.selects(name) for name in WIKITEXT_FILES.values()
        ):
            corpus = cls._open_wikitext(root, patterns)
        else:
            corpus = cls._open_folder(root, patterns)
        logger.info("opened %s as a %s corpus", root, corpus.layout)
        return corpus

    @classmethod
    def _open_hf(cls, source: HfSource, patterns: FilePatterns) -> ByteCorpus:
        """A Hugging Face dataset: its own splits, or one split cut 90/5/5 (data/hf.py)."""
        if patterns:
            raise DataError(
                f"{patterns.flags()} choose files of a folder, and --data {source} is a Hugging "
                "Face dataset; drop them"
            )
        cached = materialise(source)
        sizes = {name: file.stat().st_size for name, file in cached.files.items()}
        if cached.whole:
            (file,) = cached.files.values()
            splits = _position_split([(file, Probe("text", sizes[file.stem]))])
            missing: dict[str, Path] = {}
        else:
            splits = {n: [Span(f, 0, sizes[n])] for n, f in cached.files.items()}
            missing = {n: cached.root / f"{n}.txt" for n in SPLITS if n not in splits}
        return cls(
            cached.root,
            "hf",
            splits,
            missing,
            dataset=cached.record,
            source=str(source),
        )

    @classmethod
    def _open_wikitext(cls, root: Path, patterns: FilePatterns) -> ByteCorpus:
        """Each present ``wiki.*.raw`` is its split; absent ones fail only when asked for."""
        splits: dict[str, list[Span]] = {}
        missing: dict[str, Path] = {}
        not_utf8: list[str] = []
        budget = _GzipBudget()
        for split, name in WIKITEXT_FILES.items():
            file = root / name
            if file.is_file() and patterns.selects(name):
                probe = _check_text(file, budget)
                splits[split] = [Span(file, 0, probe.size, probe.gzip)]
                if probe.kind == "8bit":
                    not_utf8.append(name)
            else:
                missing[split] = file
        _report(root, patterns, {}, not_utf8)
        return cls(
            root,
            "wikitext",
            splits,
            missing,
            patterns=patterns,
            not_utf8=not_utf8,
            held=budget.held,
        )

    @classmethod
    def _open_folder(cls, root: Path, patterns: FilePatterns) -> ByteCorpus:
        """Every file the patterns select, split 90/5/5; the others skipped, in one line."""
        candidates = sorted(
            (p, p.relative_to(root).as_posix())
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        chosen = [(p, rel) for p, rel in candidates if patterns.selects(rel)]
        if candidates and not chosen:
            raise DataError(
                f"no file of folder {root} is chosen by {patterns.flags()} (it holds "
                f"{len(candidates)} files, e.g. {', '.join(r for _, r in candidates[:SHOWN])})"
            )
        usable: list[tuple[Path, Probe]] = []
        skipped: dict[str, list[str]] = {}
        not_utf8: list[str] = []
        budget = _GzipBudget()
        for file, rel in chosen:
            probe = _probe(file, budget)
            if probe.usable:
                usable.append((file, probe))
                if probe.kind == "8bit":
                    not_utf8.append(rel)
            else:
                skipped.setdefault(_REASONS[probe.kind], []).append(rel)
        if not usable:
            why = _summary(skipped)
            if set(skipped) <= {"empty"}:
                raise DataError(
                    f"folder {root} is empty: it holds no non-empty files"
                    + (f" ({why})" if why else "")
                )
            raise DataError(
                f"folder {root} does not look like text (binary data): none of its files is "
                f"text ({why}); {TEXT_HINT}"
            )
        _report(root, patterns, skipped, not_utf8)
        return cls(
            root,
            "folder",
            _position_split(usable),
            patterns=patterns,
            skipped=skipped,
            not_utf8=not_utf8,
            excluded=len(candidates) - len(chosen),
            held=budget.held,
        )

    def split(self, name: str) -> ByteSource:
        """Return one split, memory-mapped."""
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)}")
        if name in self._missing and self.dataset is not None:
            has = self.dataset.get("splits")
            raise DataError(
                f"the {name} split is missing: the Hugging Face dataset {self.source} has no "
                f"{' or '.join(HF_SPLIT_NAMES[name])} split (it has "
                f"{', '.join(str(v) for v in has.values()) if isinstance(has, dict) else '?'})"
            )
        if name in self._missing and self._missing[name].is_file():
            raise DataError(
                f"the {name} split is missing: {self.patterns.flags()} leave out "
                f"{self._missing[name].name} of the WikiText folder {self.root}"
            )
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

    def files(self) -> dict[str, object]:
        """Which files are read and which are not, and why: for `blocktrain data info`."""
        return {
            "include": list(self.patterns.include),
            "exclude": list(self.patterns.exclude),
            "excluded": self.excluded,
            "skipped": {reason: len(names) for reason, names in self.skipped.items()},
            "skipped_first": sorted(n for names in self.skipped.values() for n in names)[:SHOWN],
            "not_utf8": self.not_utf8,
        }

    def __repr__(self) -> str:
        return f"ByteCorpus(root={str(self.root)!r}, layout={self.layout!r})"


def load_split(
    path: DataPath | None, split: str, patterns: FilePatterns | None = None
) -> ByteSource:
    """Resolve the data path (flag, then env var), open it and return one split."""
    return ByteCorpus.open(resolve_data_path(path), patterns).split(split)


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
                maps[span.path] = _inflated(span.path)
            else:
                try:
                    maps[span.path] = np.memmap(span.path, dtype=np.uint8, mode="r")
                except (OSError, ValueError) as exc:
                    raise DataError(f"cannot read {span.path}: {exc}") from exc
        views.append(maps[span.path][span.start : span.stop])
    return views


def _position_split(files: Sequence[tuple[Path, Probe]]) -> dict[str, list[Span]]:
    """Cut every file's text at 90% and 95% of its length into train, valid and test spans."""
    splits: dict[str, list[Span]] = {name: [] for name in SPLITS}
    for file, probe in files:
        size = probe.size
        cut_train = int(size * SPLIT_FRACTIONS[0])
        cut_valid = int(size * SPLIT_FRACTIONS[1])
        splits["train"].append(Span(file, 0, cut_train, probe.gzip))
        splits["valid"].append(Span(file, cut_train, cut_valid, probe.gzip))
        splits["test"].append(Span(file, cut_valid, size, probe.gzip))
    return splits


def _summary(skipped: dict[str, list[str]]) -> str:
    """``skipped 5 files: 3 not text, 2 empty (first: a.bin, b.png, c.txt)``, or ""."""
    total = sum(len(names) for names in skipped.values())
    if not total:
        return ""
    counts = Counter({reason: len(names) for reason, names in skipped.items()})
    first = sorted(n for names in skipped.values() for n in names)[:SHOWN]
    parts = ", ".join(f"{n} {reason}" for reason, n in counts.most_common())
    return f"skipped {total} file{'s' * (total != 1)}: {parts} (first: {', '.join(first)})"


_REPORTED: set[tuple[str, FilePatterns]] = set()
"""The corpora whose skipped files this process has already reported: a command that opens
its corpus for several splits says it once."""


def _report(
    root: Path, patterns: FilePatterns, skipped: dict[str, list[str]], not_utf8: list[str]
) -> None:
    """One warning line for the files a folder skips, one for those read though not UTF-8."""
    key = (str(root.resolve()), patterns)
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    if skipped:
        logger.warning("%s: %s", root, _summary(skipped))
    if not_utf8:
        n = len(not_utf8)
        logger.warning(
            "%s: read %d file%s that %s not UTF-8 as %s bytes (8-bit text such as Latin-1; "
            "first: %s)",
            root,
            n,
            "s" * (n != 1),
            "are" if n != 1 else "is",
            "their" if n != 1 else "its",
            ", ".join(not_utf8[:SHOWN]),
        )


@dataclass
class _GzipBudget:
    """What is left of GZIP_MAX_BYTES while one corpus opens, and the text decompressed so
    far (held until the corpus holds it)."""

    left: int = field(default_factory=lambda: GZIP_MAX_BYTES)
    held: list[np.ndarray] = field(default_factory=list)


_INFLATED: weakref.WeakValueDictionary[tuple[str, int, int], np.ndarray] = (
    weakref.WeakValueDictionary()
)
"""Decompressed gzip files, by (path, size, mtime), while some corpus or split holds them."""


class _TooLarge(Exception):
    pass


def _inflated(path: Path, limit: int | None = None) -> np.ndarray:
    """The decompressed text of a gzip file, as uint8, from the cache when it is there;
    `limit`: the most bytes it may hold (default GZIP_MAX_BYTES). Read errors are DataError;
    more text than the limit raises _TooLarge."""
    limit = GZIP_MAX_BYTES if limit is None else limit
    try:
        stat = path.stat()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    cached = _INFLATED.get(key)
    if cached is not None:
        if len(cached) > limit:
            raise _TooLarge
        return cached
    data = bytearray()
    try:
        with gzip.open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                data += chunk
                if len(data) > limit:
                    raise _TooLarge
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path} is not a valid gzip file ({exc})") from exc
    array = np.frombuffer(bytes(data), dtype=np.uint8)
    _INFLATED[key] = array
    return array


def _probe(file: Path, budget: _GzipBudget) -> Probe:
    """What `file` holds (`_classify` of its first 64 KiB); for a gzip file, of its
    decompressed text, all of which is read (and counted against `budget`) if it is text."""
    try:
        with file.open("rb") as handle:
            sample = handle.read(SNIFF_BYTES)
    except OSError as exc:
        raise DataError(f"cannot read {file}: {exc}") from exc
    if not sample.startswith(b"\x1f\x8b"):
        kind, what = _classify(sample)
        return Probe(kind, file.stat().st_size if kind in ("text", "8bit") else 0, what=what)
    try:
        with gzip.open(file, "rb") as handle:
            sample = handle.read(SNIFF_BYTES)
    except (OSError, EOFError, zlib.error) as exc:
        return Probe("badgzip", gzip=True, what=f"not a valid gzip file ({exc})")
    kind, what = _classify(sample)
    if kind not in ("text", "8bit"):
        return Probe(kind, gzip=True, what=f"gzip-compressed: {what}")
    try:
        text = _inflated(file, budget.left)
    except _TooLarge:
        raise DataError(
            f"{file} decompresses to more than the {gzip_cap()} of .gz text one "
            f"corpus may hold in memory (with the corpus's other .gz files; a gzip bomb?); "
            f"decompress it yourself (`gunzip -k {file}`) to read it memory-mapped, or "
            "--exclude it"
        ) from None
    except DataError as exc:
        return Probe("badgzip", gzip=True, what=str(exc).removeprefix(f"{file} is "))
    budget.left -= len(text)
    budget.held.append(text)
    return Probe(kind, len(text), gzip=True, what=what)


def _check_text(file: Path, budget: _GzipBudget) -> Probe:
    """Fail unless ``file`` is a non-empty text file (UTF-8, 8-bit, gzip-compressed); return
    what it holds."""
    probe = _probe(file, budget)
    if probe.kind == "empty":
        raise DataError(f"{file} is empty" + (" (once decompressed)" if probe.gzip else ""))
    if probe.kind == "binary":
        inside = " once decompressed" if probe.gzip else ""
        raise DataError(f"{file} does not look like text{inside} (binary data); {TEXT_HINT}")
    if not probe.usable:
        raise DataError(f"{file} is {probe.what.replace('FILE', file.name)}; {TEXT_HINT}")
    return probe


def _classify(sample: bytes) -> tuple[TextKind, str]:
    """The kind of a file from its first bytes, and for one that is not read, what it is.

    A byte-order mark marks UTF-16/32 text; magic bytes, a compressed file or an archive; then a
    NUL byte marks binary data; valid UTF-8 is text; otherwise a file with at most 1% control
    bytes is 8-bit text (Latin-1, Windows-1252, ...), and one with more, binary data. The
    decoder is not told the sample is final, so a multi-byte character cut by the sample's end
    (at most 3 bytes) is not an error.
    """
    if not sample:
        return "empty", "empty"
    if sample.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf16", (
            "UTF-16 or UTF-32 text (it starts with a byte-order mark); convert it to UTF-8 "
            "first, e.g. `iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8`"
        )
    for magic, kind, what in _MAGIC:
        if sample.startswith(magic):
            return kind, what
    if re.match(rb"BZh[1-9]1AY&SY", sample):
        return "compressed", "bzip2-compressed (unpack it: `bunzip2 FILE`)"
    if sample[257:262] == b"ustar":
        return "archive", "a tar archive (unpack it: `tar -xf FILE`, and point --data at it)"
    if b"\x00" in sample:
        return "binary", "binary data"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
    except UnicodeDecodeError:
        controls = len(sample) - len(sample.translate(None, _CONTROLS))
        if controls > CONTROL_SHARE * len(sample):
            return "binary", "binary data"
        return "8bit", "8-bit text"
    return "text", "text"
