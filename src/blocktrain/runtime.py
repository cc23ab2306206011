"""Process-level tuning, applied once by the CLI and the benchmarks: for training on CPUs, and
for servers."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading
import time

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Stop glibc from handing large freed tensors back to the kernel.

    By default glibc serves every allocation above its mmap threshold (at most 32 MiB) with a
    fresh mmap and trims the heap after frees, so each training step page-faults its activations
    in again. Raising both thresholds keeps the memory in the process for reuse: on the `small`
    preset this cut system time per step about 5x and the step time by 5-10%
    (bench/throughput.py). Returns whether the setting took effect (glibc Linux only).
    """
    return _mallopt(mmap=1 << 30, trim=1 << 31)


TRIM_EVERY_S = 2.0
"""How often a server looks at the free part of its heap (`serve_from_heap`)."""
RETAIN_FREE_BYTES = 256 << 20
"""What it may keep free for the next requests; beyond it, `malloc_trim` hands it all back."""
_trimming = False


def serve_from_heap(trim_every_s: float = TRIM_EVERY_S, retain: int = RETAIN_FREE_BYTES) -> bool:
    """For the servers (aggregator, router, block hosts): every allocation from one heap, whose
    free part goes back to the kernel (`malloc_trim`) once it exceeds `retain` bytes, looked at
    every `trim_every_s` seconds, not at each free.

    Each push's body, its fp32 views and the commit's stacked votes are megabytes; served by
    mmaps of their own (glibc's default above its threshold, and for threads' arenas above 64
    MiB) each one page-faulted its memory in zeroed and unmapped it again: under 100 pushing
    workers most of an aggregator's samples were page faults and munmap (`perf record -g`), and
    39 of its 61 ms of CPU per update system time (bench/protocol_profile.py, protocol_profile.
    json's `heap_off_*`; 9 of 29 ms from one heap, `heap_on_*`). From one heap (no
    mmap, one arena for all threads) the freed megabytes serve the next requests. The bound is
    what keeps a flood of bodies from leaving the server at its peak (bench/live_attacks.py,
    push_flood, checks the aggregator's RSS). Returns whether the settings took effect."""
    global _trimming
    libc = _libc()
    if libc is None:
        return False
    options = ((_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1), (_M_TRIM_THRESHOLD, 1 << 30))
    ok = all([libc.mallopt(option, value) == 1 for option, value in options])
    if ok and not _trimming:  # one thread a process, however often a server starts in it
        _trimming = True
        threading.Thread(
            target=_trim_beyond, args=(libc, trim_every_s, retain), name="malloc-trim", daemon=True
        ).start()
    log.debug("glibc malloc: one heap, free beyond %d bytes trimmed: %s", retain, ok)
    return ok


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _trim_beyond(libc: ctypes.CDLL, every_s: float, retain: int) -> None:
    """Every `every_s` seconds, trim when the heap's free bytes (`mallinfo2().fordblks`) exceed
    `retain`; before glibc 2.33 (no mallinfo2), trim each time."""
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is not None:
        mallinfo2.restype = _Mallinfo2
    while True:
        time.sleep(every_s)
        if mallinfo2 is None or mallinfo2().fordblks > retain:
            libc.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's; musl lacks malloc_trim)
    except (OSError, AttributeError):
        return None
    return libc


def _mallopt(mmap: int, trim: int) -> bool:
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, trim) == 1 and ok
    log.debug("glibc mallopt thresholds: mmap %d, trim %d: %s", mmap, trim, ok)
    return ok
