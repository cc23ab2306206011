"""What a corpus file holds, judged from its first 64 KiB (README.md, "Your own corpus"), and the
text of a gzip file, decompressed into memory up to ``GZIP_MAX_BYTES`` a corpus (a gzip bomb is
an error, not an out-of-memory kill). Only a sample is read, so that opening stays cheap for any
corpus size and bad inputs fail at open rather than deep inside training."""

from __future__ import annotations

import codecs
import gzip
import re
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from blocktrain.errors import DataError

SNIFF_BYTES = 64 * 1024  # enough to catch binaries, cheap for huge corpora
# above this share of control bytes (but tab, newlines, form feed, escape), a file that is not
# UTF-8 is binary data rather than text in an 8-bit encoding
CONTROL_SHARE = 0.01
GZIP_MAX_BYTES = 1 << 30  # of .gz text a corpus holds in memory: a gzip bomb stops here


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

TextKind = Literal["text", "8bit", "empty", "binary", "utf16", "compressed", "archive", "badgzip"]

_CONTROLS = bytes(b for b in range(32) if b not in b"\t\n\v\f\r\x1b") + b"\x7f"

_MAGIC: tuple[tuple[bytes, TextKind, str], ...] = (
    (b"\xfd7zXZ\x00", "compressed", "xz-compressed (unpack it: `unxz FILE`)"),
    (b"\x28\xb5\x2f\xfd", "compressed", "zstd-compressed (unpack it: `unzstd FILE`)"),
    (b"7z\xbc\xaf\x27\x1c", "archive", "a 7-Zip archive (unpack it: `7z x FILE`)"),
    (b"PK\x03\x04", "archive", "a zip archive (unpack it: `unzip FILE`)"),
)

SKIP_REASONS: dict[TextKind, str] = {
    "empty": "empty",
    "binary": "not text",
    "utf16": "UTF-16/32 text",
    "compressed": "compressed",
    "archive": "archives",
    "badgzip": "bad gzip",
}  # how the one summary line counts the files of each kind a folder skips


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


@dataclass
class GzipBudget:
    """What is left of GZIP_MAX_BYTES while one corpus opens, and the text decompressed so
    far (held until the corpus holds it)."""

    left: int = field(default_factory=lambda: GZIP_MAX_BYTES)
    held: list[np.ndarray] = field(default_factory=list)


# decompressed gzip files, by (path, size, mtime), while some corpus or split holds them
_INFLATED: weakref.WeakValueDictionary[tuple[str, int, int], np.ndarray] = (
    weakref.WeakValueDictionary()
)


class _TooLarge(Exception):
    pass


def inflated(path: Path, limit: int | None = None) -> np.ndarray:
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


def probe_file(file: Path, budget: GzipBudget) -> Probe:
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
        text = inflated(file, budget.left)
    except _TooLarge:
        raise DataError(
            f"{file} decompresses to more than the {gzip_cap()} of .gz text one "
            f"corpus may hold in memory (with the corpus's other .gz files; a gzip bomb?); "
            f"decompress it yourself (`gunzip -k {file}`) to read it memory-mapped, or "
            "leave it out with --glob '!PATTERN'"
        ) from None
    except DataError as exc:
        return Probe("badgzip", gzip=True, what=str(exc).removeprefix(f"{file} is "))
    budget.left -= len(text)
    budget.held.append(text)
    return Probe(kind, len(text), gzip=True, what=what)


def check_text(file: Path, budget: GzipBudget) -> Probe:
    """Fail unless ``file`` is a non-empty text file (UTF-8, 8-bit, gzip-compressed); return
    what it holds."""
    probe = probe_file(file, budget)
    if probe.kind == "empty":
        raise DataError(f"{file} is empty" + (" (once decompressed)" if probe.gzip else ""))
    if probe.kind == "binary":
        inside = " once decompressed" if probe.gzip else ""
        raise DataError(f"{file} does not look like text{inside} (binary data); {TEXT_HINT}")
    if not probe.usable:
        raise DataError(f"{file} is {probe.what.replace('FILE', file.name)}; {TEXT_HINT}")
    return probe


def _classify(sample: bytes) -> tuple[TextKind, str]:
    """The kind of a file from its first bytes, and for one that is not read, what it is: a BOM
    marks UTF-16/32 text; magic bytes a compressed file or an archive; a NUL byte binary data; valid
    UTF-8 is text; else at most 1% control bytes is 8-bit text, more is binary. The decoder is not
    told the sample is final, so a multi-byte character cut by the sample's end is not an error."""
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
