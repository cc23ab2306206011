"""Hugging Face `datasets` as a corpus: ``--data hf:NAME[:CONFIG]`` (``load_dataset``) or
``--data hf:PATH`` (``load_from_disk``); README.md, "Your own corpus".

Each split's text column is written once, as UTF-8, into a cache folder keyed by the dataset's
fingerprints and the field, then memory-mapped like any corpus file, so that batches, hashes and
worker processes work as they do for files. ``datasets`` is imported only here, only for such a
corpus."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blocktrain.errors import DataError

PREFIX = "hf:"
DEFAULT_FIELD = "text"
CACHE_ENV = "BLOCKTRAIN_CACHE"
INSTALL = "pip install datasets"
SPLIT_NAMES: dict[str, tuple[str, ...]] = {  # the dataset's splits each of ours reads, in order
    "train": ("train",),
    "valid": ("validation", "valid", "dev"),
    "test": ("test",),
}
WHOLE = "all"  # the cache file of a one-split dataset, cut 90/5/5
RECORD_FILE = "dataset.json"


def is_hf(value: object) -> bool:
    """Whether a --data value names a Hugging Face dataset."""
    return isinstance(value, str | HfSource) and str(value).startswith(PREFIX)


@dataclass(frozen=True)
class HfSource:
    """A Hugging Face dataset as --data names it."""

    name: str
    config: str | None = None
    text_field: str = DEFAULT_FIELD

    @staticmethod
    def parse(spec: str) -> HfSource:
        """``hf:NAME[:CONFIG][#FIELD]``; a NAME that is an existing path is taken whole (a
        path may hold ``:``)."""
        if not spec.startswith(PREFIX):
            raise DataError(f"{spec!r} is not a Hugging Face dataset (hf:NAME[:CONFIG])")
        rest, _, field = spec[len(PREFIX) :].partition("#")
        if "#" in spec and not field:
            raise DataError(f"--data {spec}: an empty text field after '#'")
        name, config = rest, None
        if not Path(rest).expanduser().exists() and ":" in rest:
            name, _, config = rest.partition(":")
            if not config:
                raise DataError(f"--data {spec}: an empty config after ':'")
        if not name:
            raise DataError(
                f"--data {spec}: name a dataset, e.g. hf:wikitext:wikitext-2-raw-v1 or "
                "hf:/path/to/saved_dataset"
            )
        return HfSource(name, config, field or DEFAULT_FIELD)

    def __str__(self) -> str:
        out = PREFIX + self.name + (f":{self.config}" if self.config else "")
        return out + (f"#{self.text_field}" if self.text_field != DEFAULT_FIELD else "")

    @property
    def path(self) -> Path | None:
        """The local folder NAME is, or None for a Hub name."""
        path = Path(self.name).expanduser()
        return path if path.exists() else None

    def check(self) -> None:
        """Refuse a local path that does not exist (a name with a / that is no Hub id)."""
        if self.path is None and (
            self.name.startswith(("/", ".", "~")) or self.name.count("/") > 1
        ):
            raise DataError(f"--data {self}: {self.name} does not exist")


def saved_by_datasets(path: Path) -> bool:
    """Whether `path` is a folder that ``save_to_disk`` wrote."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def cache_root() -> Path:
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "blocktrain"


@dataclass(frozen=True)
class Materialised:
    """A dataset's text in the cache: one file per split it gives (or WHOLE), and what the run
    records about it."""

    root: Path
    files: dict[str, Path]
    record: dict[str, Any]

    @property
    def whole(self) -> bool:
        return WHOLE in self.files


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"--data hf:... reads a Hugging Face dataset, which needs the datasets package "
            f"({exc}): {INSTALL}"
        ) from None
    return datasets


def _load(source: HfSource) -> Any:
    """The Dataset or DatasetDict; any failure of the library is one DataError line."""
    datasets = _import_datasets()
    path = source.path
    try:
        if path is not None and saved_by_datasets(path):
            if source.config:
                raise DataError(
                    f"--data {source}: {path} is a dataset saved by save_to_disk, which has no "
                    "configs; drop ':CONFIG'"
                )
            return datasets.load_from_disk(str(path))
        return datasets.load_dataset(str(path) if path is not None else source.name, source.config)
    except DataError:
        raise
    except Exception as exc:  # the library raises many kinds: network, missing, bad config
        lines = str(exc).strip().splitlines()
        first = lines[0] if lines else ""
        raise DataError(
            f"cannot load the Hugging Face dataset {source}: {type(exc).__name__}: {first}"
        ) from exc


def _choose_splits(source: HfSource, loaded: Any) -> dict[str, tuple[str, Any]]:
    """BlockTrain's split name (or WHOLE) -> the dataset's split name and the Dataset."""
    datasets = _import_datasets()
    if isinstance(loaded, datasets.Dataset):
        return {WHOLE: (str(loaded.split or "the dataset"), loaded)}
    names = list(loaded.keys())
    if len(names) == 1:
        return {WHOLE: (names[0], loaded[names[0]])}
    if "train" not in names:
        raise DataError(
            f"the Hugging Face dataset {source} has splits {', '.join(names)} and no train "
            "split; save the one to train on as train"
        )
    chosen = {}
    for ours, theirs in SPLIT_NAMES.items():
        for name in theirs:
            if name in names:
                chosen[ours] = (name, loaded[name])
                break
    return chosen


def _check_field(source: HfSource, dataset: Any) -> None:
    columns = list(dataset.column_names)
    if source.text_field not in columns:
        strings = [c for c in columns if _is_string(dataset.features.get(c))]
        hint = f"; name one after '#' (hf:...#FIELD): {', '.join(strings)}" if strings else ""
        raise DataError(
            f"the Hugging Face dataset {source} has no column {source.text_field!r} (its "
            f"columns: {', '.join(columns)}){hint}"
        )
    if not _is_string(dataset.features.get(source.text_field)):
        raise DataError(
            f"column {source.text_field!r} of the Hugging Face dataset {source} is "
            f"{dataset.features.get(source.text_field)}, not text; name a string "
            "column after '#' (hf:...#FIELD)"
        )


def _is_string(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def materialise(source: HfSource) -> Materialised:
    """The dataset's text in the cache, written on first use (atomically: a folder renamed
    into place once complete)."""
    source.check()
    named = _choose_splits(source, _load(source))
    chosen = {k: d for k, (_, d) in named.items()}
    for dataset in chosen.values():
        _check_field(source, dataset)
    fingerprints = {k: str(getattr(d, "_fingerprint", "")) for k, d in chosen.items()}
    key_doc = {"field": source.text_field, "fingerprints": fingerprints, "format": 1}
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:20]
    record = {
        "name": source.name if source.path is None else str(source.path.resolve()),
        "config": source.config,
        "text_field": source.text_field,
        "hub": source.path is None,
        "splits": {k: name for k, (name, _) in named.items()},
        "fingerprints": fingerprints,
        "rows": {k: len(d) for k, d in chosen.items()},
    }
    root = cache_root() / "hf" / key
    files = {k: root / f"{k}.txt" for k in chosen}
    if (root / RECORD_FILE).is_file() and all(f.is_file() for f in files.values()):
        return Materialised(root, files, record)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{key}."))
    try:
        total = 0
        for ours, dataset in chosen.items():
            total += _write_text(dataset, source.text_field, tmp / f"{ours}.txt")
        if total == 0:
            raise DataError(
                f"the Hugging Face dataset {source} holds no text in column "
                f"{source.text_field!r} (every value is empty)"
            )
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        try:
            os.replace(tmp, root)
        except OSError:  # another process cached it first (a non-empty folder is not replaced)
            if not (root / RECORD_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Materialised(root, files, record)


def _write_text(dataset: Any, field: str, path: Path) -> int:
    """Write a split's text as UTF-8, a newline after each record that lacks one; the bytes."""
    written = 0
    with open(path, "wb") as f:
        for batch in dataset.select_columns([field]).iter(batch_size=1024):
            for text in batch[field]:
                if not text:
                    continue
                data = text.encode("utf-8", "surrogatepass")
                if not data.endswith(b"\n"):
                    data += b"\n"
                f.write(data)
                written += len(data)
    return written
