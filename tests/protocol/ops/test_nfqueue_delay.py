"""The release schedule of the NFQUEUE delay program (bench/nfqueue_delay.py): delay +- jitter,
in arrival order. The program itself needs root and netfilter (bench/netns.py runs it, for
tests/protocol/ops/test_netns.py and bench/wan_run.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from nfqueue_delay import release_at  # bench/nfqueue_delay.py


def schedule(spacing: float, n: int = 2000) -> list[float]:
    """The delays of n packets arriving `spacing` seconds apart, at 60 +- 20 ms."""
    rng = random.Random(0)
    previous, delays = 0.0, []
    for i in range(n):
        now = i * spacing
        at = release_at(now, 0.060, 0.020, previous, rng)
        assert at >= previous, "a packet overtook the one ahead of it"
        delays.append(at - now)
        previous = at
    return delays


def test_sparse_packets_spread_over_the_jitter() -> None:
    delays = schedule(spacing=0.1)  # further apart than the jitter's range: each its own draw
    assert 0.040 <= min(delays) < 0.042 and 0.078 < max(delays) <= 0.080
    assert abs(sum(delays) / len(delays) - 0.060) < 0.002


def test_a_burst_keeps_its_order_within_the_bound() -> None:
    # a packet every millisecond: waiting for the packet ahead lifts the delays toward the top
    # of the range, never past it (each release is some packet's own draw)
    delays = schedule(spacing=0.001)
    assert min(delays) >= 0.040 and max(delays) <= 0.080 + 1e-12
    assert sum(delays) / len(delays) > 0.070


def test_no_jitter_is_a_fixed_delay() -> None:
    rng = random.Random(0)
    assert release_at(1.0, 0.02, 0.0, 0.0, rng) == 1.02
    assert release_at(1.0, 0.02, 0.0, 1.5, rng) == 1.5  # never before the packet ahead
