"""Crash-safe file writes, shared by run folders and the aggregator's state folder, and the
reading of JSON-lines logs."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes | bytearray) -> None:
    """Write via a temporary file in the same folder, fsync it, rename it over `path`, then
    fsync the folder: a crash leaves either the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
