"""Byte-level corpora: find the text, split it, and draw windows of bytes from it (README.md,
"Your own corpus", for the layouts).

Files are memory-mapped rather than read, so that a corpus larger than memory costs nothing to
open and every batch copies only the bytes it uses."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from blocktrain.data.hf import SPLIT_NAMES as HF_SPLIT_NAMES
from blocktrain.data.hf import HfSource, is_hf, materialise, saved_by_datasets
from blocktrain.data.patterns import NO_PATTERNS, FilePatterns
from blocktrain.data.sniff import (
    SKIP_REASONS,
    TEXT_HINT,
    GzipBudget,
    Probe,
    check_text,
    probe_file,
)
from blocktrain.data.source import ByteSource, Span
from blocktrain.errors import DataError

logger = logging.getLogger(__name__)

DATA_ENV = "BLOCKTRAIN_DATA"  # names the corpus when no ``--data`` flag is given
SPLITS: tuple[str, ...] = ("train", "valid", "test")
# each split's file in a WikiText folder; the presence of any one marks the layout
WIKITEXT_FILES: dict[str, str] = {
    "train": "wiki.train.raw",
    "valid": "wiki.valid.raw",
    "test": "wiki.test.raw",
}
SPLIT_FRACTIONS: tuple[float, float] = (0.90, 0.95)  # the ends of train and valid in a file
SHOWN = 3  # file names a summary line shows
DataPath = str | os.PathLike[str] | HfSource  # what --data gives


def resolve_data_path(path: DataPath | None) -> Path | HfSource:
    """The corpus path from the flag, else from ``BLOCKTRAIN_DATA``: a Path, or for ``hf:...`` the
    HfSource (its ``str()`` is the spec again, for a child command). An empty value counts as not
    given, so ``BLOCKTRAIN_DATA=`` does not silently mean the current folder."""
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
        self.layout = layout  # "wikitext", "file", "folder" or "hf"
        self.source = source or str(root.resolve())  # the absolute path, or the hf: spec
        self.dataset = dataset  # a Hugging Face dataset's record (data/hf.py), as data.json's
        self.patterns = patterns
        self.skipped = skipped or {}  # a folder's files not read, by reason (relative paths)
        self.not_utf8 = not_utf8 or []  # files read as their bytes though not UTF-8
        self.excluded = excluded  # a folder's files the patterns leave out
        self._splits = splits
        self._missing = missing or {}
        # its gzip files' text, held while the corpus is, so that its splits map it from the
        # cache instead of decompressing it again
        self._held = held or []

    @classmethod
    def open(cls, path: DataPath, patterns: FilePatterns | None = None) -> ByteCorpus:
        """Open a WikiText folder, a text file, a folder of text files or a Hugging Face dataset
        (``hf:...``); `patterns` choose the files of a folder. Only the first 64 KiB of each file is
        read here, so opening is cheap for any corpus size and bad inputs fail now, not in training.
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
            budget = GzipBudget()
            probe = check_text(root, budget)
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
                f"folder of text: pass --data hf:{root} (hf:{root}#FIELD for a column other "
                "than text)"
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
        budget = GzipBudget()
        for split, name in WIKITEXT_FILES.items():
            file = root / name
            if file.is_file() and patterns.selects(name):
                probe = check_text(file, budget)
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
        budget = GzipBudget()
        for file, rel in chosen:
            probe = probe_file(file, budget)
            if probe.usable:
                usable.append((file, probe))
                if probe.kind == "8bit":
                    not_utf8.append(rel)
            else:
                skipped.setdefault(SKIP_REASONS[probe.kind], []).append(rel)
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


# the corpora whose skipped files this process reported: a command that opens its corpus for
# several splits says it once
_REPORTED: set[tuple[str, FilePatterns]] = set()


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
