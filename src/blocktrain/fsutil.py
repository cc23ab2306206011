"""Crash-safe file writes, shared by run folders and the aggregator's state folder, and the
reading of JSON-lines logs."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DIRECT_FROM = 1 << 20
"""Bytes from which a write bypasses the page cache (O_DIRECT, where the file system takes it).
An aggregator writes every pushed body once and reads it again only after a crash. Rounds of
100 writes of a 2 MB body, each removed at the round's end as a commit does, cost 3.7 ms of CPU
a write through the page cache (10.7 in the worst of 10 rounds) against 1.2 direct (2.0 at
worst): bench/durable_write.py, durable_write.json."""
ALIGN = 4096
"""O_DIRECT's alignment of buffer, offset and length: a multiple of every common block size."""
STAGE = 1 << 20
"""The aligned buffer a thread copies a large write through, one piece at a time."""

_stages = threading.local()


def atomic_write_bytes(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write via a temporary file in the same folder, fsync it, rename it over `path`, then
    fsync the folder: a crash leaves either the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            _write(fd, memoryview(data).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write(fd: int, data: memoryview) -> None:
    """All of `data` to the empty file `fd`: direct when it is large and the file system takes
    O_DIRECT, through the page cache otherwise (or after a direct write it refused)."""
    direct = getattr(os, "O_DIRECT", 0)  # Linux only
    if direct and len(data) >= DIRECT_FROM:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct)
            _write_direct(fd, data)
            os.ftruncate(fd, len(data))  # the last piece was padded to ALIGN
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: no O_DIRECT here, or not at this alignment
                raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
    while data:
        data = data[os.write(fd, data) :]


def _write_direct(fd: int, data: memoryview) -> None:
    """`data` in STAGE pieces through this thread's aligned buffer (an mmap: page-aligned, and
    kept, since fresh pages cost a fault each), the last one zero-padded to ALIGN."""
    stage = getattr(_stages, "buffer", None)
    if stage is None:
        stage = _stages.buffer = mmap.mmap(-1, STAGE)
    for at in range(0, len(data), STAGE):
        piece = data[at : at + STAGE]
        n = len(piece)
        stage[:n] = piece
        padded = -(-n // ALIGN) * ALIGN
        stage[n:padded] = bytes(padded - n)
        with memoryview(stage) as whole:
            if os.write(fd, whole[:padded]) != padded:
                raise OSError(errno.EINVAL, "a short direct write")


def json_lines(path: Path, error: type[Exception]) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON-lines file; `error`, naming the
    path (and the line), for a file that cannot be read or a line that is not JSON."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise error(f"{path} is not readable: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise error(f"{path} line {n} is not JSON: {exc}") from exc
            yield n, value
