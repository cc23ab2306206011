"""Training and evaluation text: byte corpora on disk, their splits, and the WikiText download.
Problems a user can fix raise `blocktrain.errors.DataError`."""

from __future__ import annotations

from blocktrain.data.corpus import (
    DATA_ENV,
    ByteCorpus,
    load_split,
    resolve_data_path,
)
from blocktrain.data.fetch import URL_ENV, fetch_wikitext
from blocktrain.data.patterns import FilePatterns
from blocktrain.data.source import ByteSource

__all__ = [
    "DATA_ENV",
    "URL_ENV",
    "ByteCorpus",
    "ByteSource",
    "FilePatterns",
    "fetch_wikitext",
    "load_split",
    "resolve_data_path",
]
