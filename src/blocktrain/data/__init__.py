"""Training and evaluation text: byte corpora on disk, their splits, and the WikiText download.

Everything here raises `blocktrain.errors.DataError` for problems a user can fix (a missing path,
an empty or binary file, a split that is not there, a failed download).
"""

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
