"""fsutil.atomic_write_bytes: large writes bypass the page cache where the file system allows,
and every path leaves the same bytes, or the old file, and no temporary."""

import errno
import os

import pytest

from blocktrain import fsutil


@pytest.fixture
def small_pieces(monkeypatch):
    """Direct from 3 pages on, in pieces of 2: the boundaries without megabytes of data."""
    monkeypatch.setattr(fsutil, "DIRECT_FROM", 3 * fsutil.ALIGN)
    monkeypatch.setattr(fsutil, "STAGE", 2 * fsutil.ALIGN)
    monkeypatch.setattr(fsutil, "_stages", type(fsutil._stages)())


@pytest.fixture
def direct_calls(monkeypatch):
    calls = []
    write_direct = fsutil._write_direct

    def spy(fd, data):
        calls.append(len(data))
        write_direct(fd, data)

    monkeypatch.setattr(fsutil, "_write_direct", spy)
    return calls


@pytest.mark.parametrize("n", [0, 1, 3 * 4096 - 1, 3 * 4096, 4 * 4096, 5 * 4096 + 7, 50_001])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_every_size_round_trips(tmp_path, small_pieces, direct_calls, n, kind):
    data = os.urandom(n)
    path = tmp_path / "f.bin"
    fsutil.atomic_write_bytes(path, kind(data) if kind is not memoryview else memoryview(data))
    assert path.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    assert direct_calls == ([n] if n >= fsutil.DIRECT_FROM and hasattr(os, "O_DIRECT") else [])


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, small_pieces, monkeypatch):
    """EINVAL after a piece is on disk (a file system without O_DIRECT, or with other alignment):
    the file is written again from its start, buffered."""

    def half_then_refuse(fd, data):
        os.write(fd, bytes(fsutil.ALIGN))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fsutil, "_write_direct", half_then_refuse)
    data = os.urandom(7 * fsutil.ALIGN + 3)
    fsutil.atomic_write_bytes(tmp_path / "f.bin", data)
    assert (tmp_path / "f.bin").read_bytes() == data


def test_another_error_keeps_the_old_file_and_no_temporary(tmp_path, small_pieces, monkeypatch):
    path = tmp_path / "f.bin"
    fsutil.atomic_write_bytes(path, b"old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil, "_write_direct", full)
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform: every write is buffered")
    with pytest.raises(OSError, match="No space"):
        fsutil.atomic_write_bytes(path, os.urandom(4 * fsutil.ALIGN))
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
