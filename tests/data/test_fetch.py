"""Tests of the WikiText download: served from a local zip, never from the internet.

Each download test runs twice: from a ``file://`` URL (always) and from a loopback HTTP server on
127.0.0.1 (marked ``network``, the project's marker for tests that start servers).
"""

from __future__ import annotations

import functools
import hashlib
import socket
import threading
import zipfile
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from blocktrain.data import URL_ENV, fetch_wikitext
from blocktrain.errors import DataError

SPLIT_TEXT = {
    "wiki.train.raw": b" = Train = \n train text \n" * 50,
    "wiki.valid.raw": b" = Valid = \n valid text \n" * 10,
    "wiki.test.raw": b" = Test = \n test text \n" * 10,
}

Serve = Callable[[Path], str]
"""Make a folder reachable and return its base URL (no trailing slash)."""


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Keep request logs out of the test output."""


def _make_zip(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in members.items():
            bundle.writestr(name, data)
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    members = {f"wikitext-2-raw/{name}": data for name, data in SPLIT_TEXT.items()}
    members["../evil.raw"] = b"must never be written"
    members["wikitext-2-raw/notes.txt"] = b"not a split"
    return _make_zip(tmp_path / "site" / "wikitext-2-raw-v1.zip", members)


@pytest.fixture
def serve_http() -> Iterator[Serve]:
    servers: list[tuple[ThreadingHTTPServer, threading.Thread]] = []

    def serve(folder: Path) -> str:
        handler = functools.partial(_QuietHandler, directory=str(folder))
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(params=["file", pytest.param("http", marks=pytest.mark.network)])
def serve(request: pytest.FixtureRequest) -> Serve:
    if request.param == "http":
        served: Serve = request.getfixturevalue("serve_http")
        return served
    return lambda folder: folder.resolve().as_uri()


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_fetch_extracts_only_the_three_splits(tmp_path: Path, archive: Path, serve: Serve) -> None:
    url = f"{serve(archive.parent)}/{archive.name}"
    seen: list[tuple[int, int | None]] = []
    dest = tmp_path / "out" / "wikitext-2"
    result = fetch_wikitext(
        "wikitext-2", dest, url=url, progress=lambda done, total: seen.append((done, total))
    )
    assert result == dest
    assert sorted(p.name for p in dest.iterdir()) == sorted(SPLIT_TEXT)
    for name, data in SPLIT_TEXT.items():
        assert (dest / name).read_bytes() == data
    assert _files_under(tmp_path / "out") == sorted(dest / name for name in SPLIT_TEXT)
    assert not list(tmp_path.rglob("evil.raw"))
    size = archive.stat().st_size
    assert seen[-1] == (size, size)


def test_fetch_checks_a_given_sha256(tmp_path: Path, archive: Path, serve: Serve) -> None:
    url = f"{serve(archive.parent)}/{archive.name}"
    dest = tmp_path / "good"
    fetch_wikitext("wikitext-2", dest, url=url, sha256=_sha256(archive).upper())
    assert (dest / "wiki.test.raw").read_bytes() == SPLIT_TEXT["wiki.test.raw"]


def test_sha256_mismatch_leaves_nothing(tmp_path: Path, archive: Path, serve: Serve) -> None:
    url = f"{serve(archive.parent)}/{archive.name}"
    dest = tmp_path / "out" / "wikitext-2"
    with pytest.raises(DataError, match="checksum mismatch"):
        fetch_wikitext("wikitext-2", dest, url=url, sha256="0" * 64)
    assert _files_under(tmp_path / "out") == []


def test_mirror_from_env_is_checked_against_the_published_digest(
    tmp_path: Path, archive: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mirror serves a file named like the official archive, so the official digest applies;
    # this fake archive does not match it.
    monkeypatch.setenv(URL_ENV, serve(archive.parent) + "/")
    dest = tmp_path / "out" / "wikitext-2"
    with pytest.raises(DataError, match="ef7edb566e3e"):
        fetch_wikitext("wikitext-2", dest)
    assert _files_under(tmp_path / "out") == []
    fetch_wikitext("wikitext-2", dest, sha256=_sha256(archive))
    assert (dest / "wiki.valid.raw").read_bytes() == SPLIT_TEXT["wiki.valid.raw"]


def test_traversal_member_lands_inside_dest(tmp_path: Path, serve: Serve) -> None:
    members = {"../../wiki.train.raw": b"escaped?\n", "/abs/wiki.valid.raw": b"absolute\n"}
    members["x/wiki.test.raw"] = b"plain\n"
    bundle = _make_zip(tmp_path / "site" / "bad.zip", members)
    dest = tmp_path / "a" / "b" / "dest"
    fetch_wikitext("wikitext-2", dest, url=f"{serve(bundle.parent)}/bad.zip")
    assert (dest / "wiki.train.raw").read_bytes() == b"escaped?\n"
    assert (dest / "wiki.valid.raw").read_bytes() == b"absolute\n"
    assert _files_under(tmp_path / "a") == sorted(dest / name for name in SPLIT_TEXT)


def test_existing_dest_is_overwritten(tmp_path: Path, archive: Path, serve: Serve) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "wiki.train.raw").write_bytes(b"old")
    fetch_wikitext("wikitext-2", dest, url=f"{serve(archive.parent)}/{archive.name}")
    assert (dest / "wiki.train.raw").read_bytes() == SPLIT_TEXT["wiki.train.raw"]


def test_archive_without_splits_or_not_a_zip(tmp_path: Path, serve: Serve) -> None:
    site = tmp_path / "site"
    _make_zip(site / "partial.zip", {"w/wiki.train.raw": b"only train\n"})
    (site / "junk.zip").write_bytes(b"this is not a zip file")
    base = serve(site)
    with pytest.raises(DataError, match=r"lacks wiki\.valid\.raw, wiki\.test\.raw"):
        fetch_wikitext("wikitext-2", tmp_path / "d1", url=f"{base}/partial.zip")
    with pytest.raises(DataError, match="not a zip archive"):
        fetch_wikitext("wikitext-2", tmp_path / "d2", url=f"{base}/junk.zip")
    assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()
    assert not list(tmp_path.glob(".*.part"))


def test_missing_file_on_the_server(tmp_path: Path, serve: Serve) -> None:
    (tmp_path / "site").mkdir()
    with pytest.raises(DataError, match="could not download"):
        fetch_wikitext("wikitext-2", tmp_path / "d", url=f"{serve(tmp_path / 'site')}/none.zip")


def test_unreachable_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/x.zip"
    with pytest.raises(DataError, match=r"could not download .*may have no internet"):
        fetch_wikitext("wikitext-2", tmp_path / "d", url=url, timeout=5.0)
    assert _files_under(tmp_path) == []


def test_unknown_name_lists_the_choices(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="wikitext-2, wikitext-103"):
        fetch_wikitext("wikitext-3", tmp_path / "d")
