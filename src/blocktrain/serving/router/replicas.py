"""Block replicas in the router: several hosts at one position of `--hosts`, joined by `|`, and
the health scores that choose among them (docs/serving.md, "Batching, readiness and replicas").
A failed replica is skipped for `cooldown_s` and the same message goes to the next: a host's
answer depends only on the message, so the retry computes what the failed host would have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blocktrain.errors import ConfigError

SEPARATOR = "|"
LATENCY_WEIGHT = 0.2
"""Weight of the newest traversal in a replica's latency average."""


def parse_positions(
    entries: tuple[str, ...], check: Callable[[str], str]
) -> tuple[tuple[str, ...], ...]:
    """`--hosts` entries (each one URL or `URL|URL|...`) -> the replicas per position, each URL
    checked by `check`; a URL may appear only once in the whole chain."""
    positions = tuple(
        tuple(check(u.strip()) for u in entry.split(SEPARATOR) if u.strip()) for entry in entries
    )
    flat = [u for p in positions for u in p]
    if any(not p for p in positions):
        raise ConfigError(f"--hosts has an empty position: {','.join(entries)}")
    if len(set(flat)) != len(flat):
        raise ConfigError(f"--hosts lists a host twice: {', '.join(flat)}")
    return positions


@dataclass
class _Score:
    latency_s: float | None = None
    in_flight: int = 0
    failures: int = 0
    successes: int = 0
    failed_at: float | None = None
    last_error: str | None = None


class Health:
    """Recent failures and latency per host; `order` ranks a position's replicas."""

    def __init__(self, clock: Callable[[], float], cooldown_s: float = 30.0) -> None:
        self.clock, self.cooldown_s = clock, cooldown_s
        self._scores: dict[str, _Score] = {}

    def _score(self, url: str) -> _Score:
        return self._scores.setdefault(url, _Score())

    def recently_failed(self, url: str) -> bool:
        at = self._score(url).failed_at
        return at is not None and self.clock() - at < self.cooldown_s

    def order(self, urls: tuple[str, ...]) -> list[str]:
        """Healthy replicas first, then by expected wait: (in flight + 1) x recent latency (an
        unmeasured replica counts as fast, so that every replica gets measured)."""

        def rank(url: str) -> tuple[bool, float]:
            s = self._score(url)
            return self.recently_failed(url), (s.in_flight + 1) * (s.latency_s or 0.0)

        return sorted(urls, key=rank)  # stable: ties keep the --hosts order

    def started(self, url: str) -> None:
        self._score(url).in_flight += 1

    def succeeded(self, url: str, seconds: float) -> None:
        s = self._score(url)
        s.in_flight -= 1
        s.successes += 1
        s.failed_at = None
        s.latency_s = (
            seconds
            if s.latency_s is None
            else (1 - LATENCY_WEIGHT) * s.latency_s + LATENCY_WEIGHT * seconds
        )

    def failed(self, url: str, reason: str, *, in_flight: bool = True) -> None:
        s = self._score(url)
        if in_flight:
            s.in_flight -= 1
        s.failures += 1
        s.failed_at = self.clock()
        s.last_error = reason

    def describe(self, url: str) -> dict[str, Any]:
        s = self._score(url)
        return {
            "healthy": not self.recently_failed(url),
            "latency_ms": None if s.latency_s is None else round(s.latency_s * 1000, 3),
            "in_flight": s.in_flight,
            "successes": s.successes,
            "failures": s.failures,
            "last_error": s.last_error,
        }
