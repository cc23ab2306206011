"""Download the official WikiText archives and unpack their three raw splits.

The archive is streamed to a temporary file next to the destination, checked against its sha256
before anything is unpacked, and each split is written through a temporary file and
``os.replace``, so an interrupted or corrupt download never leaves a half-written corpus behind.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from blocktrain.errors import DataError

logger = logging.getLogger(__name__)

URL_ENV = "BLOCKTRAIN_WIKITEXT_URL"  # a mirror's base URL (before the archive's file name)

DEFAULT_BASE_URL = "https://wikitext.smerity.com"

WIKITEXT_ARCHIVES: dict[str, str] = {
    "wikitext-2": "wikitext-2-raw-v1.zip",
    "wikitext-103": "wikitext-103-raw-v1.zip",
}

KNOWN_SHA256: dict[str, str] = {  # published digests (4,721,645 bytes for WikiText-2)
    "wikitext-2-raw-v1.zip": "ef7edb566e3e2b2d31b29c1fdb0c89a4cc683597484c3dc2517919c615435a11",
}

MEMBERS: tuple[str, ...] = ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")  # unpacked

CHUNK = 1 << 20

Progress = Callable[[int, int | None], None]  # bytes so far, and the total (None: not said)


def fetch_wikitext(
    name: str,
    dest: str | os.PathLike[str],
    *,
    url: str | None = None,
    sha256: str | None = None,
    progress: Progress | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download WikiText ``name`` and unpack its raw splits into ``dest``; return ``dest``. The URL:
    ``url``, else ``$BLOCKTRAIN_WIKITEXT_URL/<archive>``, else the official one; the digest:
    ``sha256``, else the published one when fetched by its official name, else none."""
    archive = _archive_name(name)
    source = url or f"{_base_url()}/{archive}"
    expected = sha256 or (None if url else KNOWN_SHA256.get(archive))
    if expected is None:
        logger.warning("no sha256 known for %s; the download will not be verified", source)
    target = Path(dest).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{archive}.", suffix=".part", dir=target.parent)
    os.close(handle)
    temp = Path(temp_name)
    try:
        digest = _download(source, temp, progress, timeout)
        if expected is not None and digest != expected.lower():
            raise DataError(
                f"checksum mismatch for {source}: sha256 is {digest}, expected {expected}; "
                "the download is corrupt or not the official archive"
            )
        _extract(temp, target, source)
    finally:
        temp.unlink(missing_ok=True)
    logger.info("wrote %s to %s", ", ".join(MEMBERS), target)
    return target


def _archive_name(name: str) -> str:
    """Map a corpus name to its archive, failing with the accepted names."""
    try:
        return WIKITEXT_ARCHIVES[name]
    except KeyError:
        choices = ", ".join(WIKITEXT_ARCHIVES)
        raise DataError(f"unknown WikiText corpus {name!r}; choose one of {choices}") from None


def _base_url() -> str:
    """The mirror from the environment, else the official site; no trailing slash."""
    return (os.environ.get(URL_ENV) or DEFAULT_BASE_URL).rstrip("/")


def _download(url: str, file: Path, progress: Progress | None, timeout: float) -> str:
    """Stream ``url`` into ``file`` in chunks and return the hex sha256 of what was written."""
    hasher = hashlib.sha256()
    logger.info("downloading %s", url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, file.open("wb") as out:
            total = _content_length(response.headers.get("Content-Length"))
            done = 0
            if progress is not None:
                progress(done, total)
            while chunk := response.read(CHUNK):
                out.write(chunk)
                hasher.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
    except urllib.error.HTTPError as exc:
        raise DataError(
            f"could not download {url}: HTTP {exc.code} {exc.reason}; check the URL or {URL_ENV}"
        ) from exc
    except urllib.error.URLError as exc:
        raise DataError(
            f"could not download {url}: {exc.reason}; this machine may have no internet"
        ) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise DataError(
            f"could not download {url}: {exc}; this machine may have no internet"
        ) from exc
    if total is not None and done != total:
        raise DataError(f"could not download {url}: got {done} of {total} bytes; try again")
    return hasher.hexdigest()


def _content_length(value: str | None) -> int | None:
    """Parse a Content-Length header; absent or malformed means unknown."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _extract(archive: Path, dest: Path, source: str) -> None:
    """Write the three raw splits of ``archive`` into ``dest``, by base name only, so that no member
    name (``../x``, absolute paths) can place a file outside ``dest``. All three members must be
    present before anything is written."""
    try:
        with zipfile.ZipFile(archive) as bundle:
            chosen = _choose_members(bundle.infolist())
            missing = [m for m in MEMBERS if m not in chosen]
            if missing:
                raise DataError(
                    f"{source} is not a WikiText archive: it lacks {', '.join(missing)}"
                )
            dest.mkdir(parents=True, exist_ok=True)
            for base, info in chosen.items():
                _write_member(bundle, info, dest / base)
    except zipfile.BadZipFile as exc:
        raise DataError(f"{source} is not a zip archive: {exc}") from exc


def _choose_members(infos: list[zipfile.ZipInfo]) -> dict[str, zipfile.ZipInfo]:
    """Pick the first member whose base name is each wanted split file."""
    chosen: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if info.is_dir():
            continue
        base = PurePosixPath(info.filename.replace("\\", "/")).name
        if base in MEMBERS and base not in chosen:
            chosen[base] = info
    return chosen


def _write_member(bundle: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path) -> None:
    """Unpack one member to ``target`` through a temporary file and an atomic rename."""
    handle, temp_name = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".part", dir=target.parent
    )
    try:
        with os.fdopen(handle, "wb") as out, bundle.open(info) as member:
            shutil.copyfileobj(member, out, CHUNK)
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
