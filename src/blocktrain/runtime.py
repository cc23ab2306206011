"""Process-level tuning, applied once by the CLI and the benchmarks: for training on CPUs, and
for servers."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Stop glibc from handing large freed tensors back to the kernel.

    By default glibc serves every allocation above its mmap threshold (at most 32 MiB) with a
    fresh mmap and trims the heap after frees, so each training step page-faults its activations
    in again. Raising both thresholds keeps the memory in the process for reuse: on the `small`
    preset this cut system time per step about 5x and the step time by 5-10%
    (bench/throughput.py). Returns whether the setting took effect (glibc Linux only).
    """
    return _mallopt(mmap=1 << 30, trim=1 << 31)


SERVER_MMAP_THRESHOLD = 128 << 10
"""glibc's own starting threshold, held fixed (setting it turns off glibc's raising it)."""


def return_freed_memory() -> bool:
    """For the servers (aggregator, router, block hosts): serve every allocation of 128 KiB or
    more (a request body, its tensors) with its own mmap and trim the heap, so that what a flood
    of requests held goes back to the kernel when they are answered. Under keep_freed_memory's
    thresholds an aggregator pushed valid-shaped 1 MB bodies by one token (bench/
    live_attacks.py, push_flood) grew from 486 to 821 MB and stayed there. The cost is the
    page faults of the probe's forward passes, a small part of a server's work."""
    return _mallopt(mmap=SERVER_MMAP_THRESHOLD, trim=2 * SERVER_MMAP_THRESHOLD)


def _mallopt(mmap: int, trim: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, trim) == 1 and ok
    except (OSError, AttributeError):
        return False
    log.debug("glibc mallopt thresholds: mmap %d, trim %d: %s", mmap, trim, ok)
    return ok
