"""Training and evaluation text: byte corpora on disk, their splits, and the WikiText download.
Problems a user can fix raise `blocktrain.errors.DataError`."""

from __future__ import annotations

from blocktrain.data.corpus import (
    DATA_ENV,
    SPLITS,
    ByteCorpus,
    load_split,
    resolve_data_path,
)
from blocktrain.data.fetch import URL_ENV, WIKITEXT_ARCHIVES, fetch_wikitext
from blocktrain.data.patterns import FilePatterns
from blocktrain.data.source import ByteSource

__all__ = [
    "DATA_ENV",
    "SPLITS",
    "URL_ENV",
    "WIKITEXT_ARCHIVES",
    "ByteCorpus",
    "ByteSource",
    "FilePatterns",
    "fetch_wikitext",
    "load_split",
    "resolve_data_path",
]
