"""What a client may cost the aggregator (`AccessLimits`: the server's, not the run's, so not
saved in the state folder), and per-token request rates (`rate_limit`, on
`httpserve.TokenBucket`: a refusal is 429 `rate_limited` with its Retry-After)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from blocktrain.errors import ConfigError, Refused
from blocktrain.httpserve import Limits, TokenBucket
from blocktrain.protocol.core.verdict import refused

JSON_BODY_BYTES = 16 * 1024
"""The cap on JSON bodies (POST /v1/workers takes a few dozen bytes)."""


@dataclass(frozen=True)
class AccessLimits:
    """The aggregator's limits. Pushes take the run's `max_body_bytes`; every other body
    `http.max_body`."""

    http: Limits = field(default_factory=lambda: Limits(max_body=JSON_BODY_BYTES))
    rate_per_s: float = 50.0
    """Requests a second per token, after a burst of `burst`."""
    burst: int = 200
    private_status: bool = False
    """/metrics needs a token too (/v1/status always does)."""
    public_weights: bool = False
    """GET /v1/blocks/{b}/versions/{v} needs no token, and CDNs may cache it for everyone."""
    keep_refused: int = 100_000
    """Refused updates kept in the ledger (the oldest are pruned; the counts keep them)."""
    prune_every_s: float = 60.0

    def __post_init__(self) -> None:
        if self.keep_refused < 0 or not self.prune_every_s > 0:
            raise ConfigError("keep_refused must be >= 0 and prune_every_s positive")
        _check_rate(self.rate_per_s, self.burst)


def _check_rate(rate_per_s: float, burst: int) -> None:
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)) or burst < 1:
        raise ConfigError(f"--rate-limit {rate_per_s} and its burst {burst} must be positive")


class RateLimited(Refused):
    """A `rate_limited` refusal that says when to come back."""

    def __init__(self, detail: str, retry_after_s: float) -> None:
        base = refused("rate_limited", detail)
        super().__init__(base.reason, base.detail, base.status)
        self.retry_after_s = retry_after_s


def rate_limit(bucket: TokenBucket, token_id: int) -> None:
    """Take one request from the token's bucket, or raise RateLimited."""
    wait = bucket.take(token_id)
    if wait:
        raise RateLimited(
            f"more than {bucket.rate_per_s:g} requests/s (burst {bucket.burst}) from this "
            f"token; retry in {wait:.2f}s",
            wait,
        )
