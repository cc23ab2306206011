"""What corpus a run was trained on: RUN_DIR/data.json, written by `blocktrain train`, and the
one warning line `eval`, `generate --data` and `train --resume` print when the data given now
differs from it.

Data is the same when a split's bytes are (its SHA-256), wherever the corpus lies now: a moved
copy raises no warning, an edited file or another corpus does."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from blocktrain.data.corpus import (
    SPLIT_FRACTIONS,
    SPLITS,
    WIKITEXT_FILES,
    ByteCorpus,
    DataPath,
    resolve_data_path,
)
from blocktrain.data.patterns import FilePatterns
from blocktrain.errors import DataError
from blocktrain.fsutil import atomic_write_bytes

DATA_FILE = "data.json"

_TRAIN, _VALID = (round(100 * f) for f in SPLIT_FRACTIONS)
SPLIT_RULES = {
    "wikitext": "each split is its file: " + ", ".join(WIKITEXT_FILES.values()),
    "file": f"by position in the file: train the first {_TRAIN}%, valid the next "
    f"{_VALID - _TRAIN}%, test the last {100 - _VALID}%",
    "folder": f"by position in every text file of the folder: train the first {_TRAIN}%, "
    f"valid the next {_VALID - _TRAIN}%, test the last {100 - _VALID}%",
    "hf": "the Hugging Face dataset's own splits: train, validation (or valid, dev), test",
    "hf-one": f"by position in the text of the Hugging Face dataset's one split: train the "
    f"first {_TRAIN}%, valid the next {_VALID - _TRAIN}%, test the last {100 - _VALID}%",
}


def split_rule(corpus: ByteCorpus) -> str:
    """How `corpus` is cut into train, valid and test, in words."""
    if corpus.layout == "hf" and corpus.dataset and "all" in (corpus.dataset.get("splits") or {}):
        return SPLIT_RULES["hf-one"]
    return SPLIT_RULES[corpus.layout]


def corpus_record(
    path: DataPath | None,
    splits: Iterable[str] = SPLITS,
    patterns: FilePatterns | None = None,
) -> dict[str, Any]:
    """The corpus at --data `path` (or $BLOCKTRAIN_DATA), its files chosen by `patterns`: where
    it lies, its layout, split rule and patterns, and per split of `splits` it has, its size,
    SHA-256 and files."""
    root = resolve_data_path(path)
    corpus = ByteCorpus.open(root, patterns)
    record: dict[str, Any] = {}
    for name in splits:
        try:
            source = corpus.split(name)
        except DataError:  # a WikiText folder without this split
            continue
        record[name] = {
            "bytes": len(source),
            "sha256": source.sha256(),
            "files": [str(p.resolve()) for p in source.paths],
        }
    out: dict[str, Any] = {
        "path": corpus.source,
        "layout": corpus.layout,
        "split_rule": split_rule(corpus),
        "include": list(corpus.patterns.include),
        "exclude": list(corpus.patterns.exclude),
        "splits": record,
    }
    if corpus.dataset is not None:
        out["dataset"] = corpus.dataset
    return out


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    atomic_write_bytes(Path(run_dir) / DATA_FILE, (json.dumps(record, indent=2) + "\n").encode())


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's data.json, or None for a run without one (or one that cannot be read)."""
    try:
        doc = json.loads((Path(run_dir) / DATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("splits"), dict) else None


def differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The splits of `now` whose bytes differ from the same split in `recorded`."""
    return [
        name
        for name, split in now["splits"].items()
        if name in recorded["splits"] and recorded["splits"][name].get("sha256") != split["sha256"]
    ]


def check_data(
    run_dir: Path,
    path: DataPath | None,
    splits: Iterable[str],
    patterns: FilePatterns | None = None,
) -> dict[str, Any]:
    """The data given now for `splits` (its files chosen by `patterns`), as eval's JSON names
    it, compared with what `run_dir` recorded: one `blocktrain: warning:` line on stderr when a
    split's bytes differ, which names the patterns the run was trained with when they are not
    the ones given now."""
    now = corpus_record(path, splits, patterns)
    recorded = read_record(run_dir)
    changed = [] if recorded is None else differences(recorded, now)
    now["trained_on"] = None if recorded is None else recorded["path"]
    now["same_as_training"] = None if recorded is None else not changed
    if recorded is not None and changed:
        name = changed[0]
        print(
            f"blocktrain: warning: {run_dir} was trained on other data: the {name} split of "
            f"{now['path']} (sha256 {now['splits'][name]['sha256'][:12]}) is not the one it "
            f"recorded from {recorded['path']} (sha256 "
            f"{recorded['splits'][name]['sha256'][:12]}); its numbers are not comparable"
            + _pattern_hint(recorded, now),
            file=sys.stderr,
            flush=True,
        )
    return now


def _pattern_hint(recorded: dict[str, Any], now: dict[str, Any]) -> str:
    """The warning's end that names the patterns the run was trained with, when they are not
    those given now; empty when they are."""
    then = FilePatterns(tuple(recorded.get("include", ())), tuple(recorded.get("exclude", ())))
    given = FilePatterns(tuple(now["include"]), tuple(now["exclude"]))
    if then == given:
        return ""
    return (
        f"; it was trained with {then.flags() or 'no --glob'} "
        f"(given now: {given.flags() or 'none'})"
    )
