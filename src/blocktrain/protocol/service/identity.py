"""Who is calling: the bearer token (stored hashed in the ledger) and the worker it speaks for.
An unknown token and a revoked one read the same on the wire (`invalid_token`): a guess learns
no more than no. The log tells them apart."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from blocktrain.protocol.core.verdict import Verdict, refused
from blocktrain.protocol.store.ledger import Ledger
from blocktrain.protocol.store.ledger_schema import TokenRow
from blocktrain.protocol.store.tokens import bearer, hash_token

log = logging.getLogger(__name__)

VIEWER_ENDPOINTS = frozenset({"status", "history", "metrics", "config", "directory", "round"})
"""What a viewer token (`blocktrain token add --viewer`) may call: what the dashboard and
`blocktrain status` read. Not register, pull, push or leave, nor the weights."""


@dataclass(frozen=True)
class Caller:
    token_id: int
    token_name: str
    worker_id: int | None


def check_may(token: TokenRow, endpoint: str) -> None:
    """Refuse a viewer token anything but watching (`viewer_token`, 403)."""
    if token.viewer and endpoint not in VIEWER_ENDPOINTS:
        raise refused(
            "viewer_token",
            f"token {token.name!r} is a viewer token: it may watch the run, not {endpoint}",
        )


def authenticate(ledger: Ledger, authorization: str | None) -> TokenRow:
    """The token of an `Authorization: Bearer` header, if known, neither banned nor revoked."""
    token = bearer(authorization)
    if isinstance(token, Verdict):
        raise refused(token.reason, token.detail)
    row = ledger.token_by_hash(hash_token(token))
    if row is not None and row.banned is not None:
        why = f": {row.ban_reason}" if row.ban_reason else ""
        raise refused("banned_token", f"token {row.name!r} was banned{why}")
    if row is None or row.revoked is not None:
        if row is not None:
            log.info("refused token %r: it was revoked", row.name)
        raise refused("invalid_token")
    return row


def identify(
    ledger: Ledger,
    token: TokenRow,
    worker_header: str | None,
    endpoint: str | None = None,
) -> Caller:
    """The authenticated `token` and, when there is one, the worker making the call (the
    X-Worker-Id header, else the token's latest registered worker); with `endpoint`, a viewer
    token is refused first (`check_may`)."""
    if endpoint is not None:
        check_may(token, endpoint)
    if worker_header is not None and worker_header.strip():
        try:
            worker_id = int(worker_header)
        except ValueError:
            raise refused(
                "unknown_worker", f"X-Worker-Id {worker_header[:40]!r} is not a worker id"
            ) from None
        # beyond SQLite's 64-bit integers no worker can exist (and the query would fail)
        row = ledger.worker(worker_id) if abs(worker_id) < 2**63 else None
        if row is None or row.left_at is not None:
            raise refused("unknown_worker", f"worker {worker_id} is not registered; register again")
        if row.token_id != token.id:
            raise refused("not_your_worker", f"worker {worker_id} belongs to another token")
        return Caller(token.id, token.name, worker_id)
    latest = ledger.latest_worker_of(token.id)
    return Caller(token.id, token.name, None if latest is None else latest.id)


def allowed_blocks(token: TokenRow, n_blocks: int, block: int | None) -> list[int] | None:
    """The blocks a token may register on (None: any), refusing a request outside them."""
    if not token.blocks:
        return None
    allowed = [b for b in token.blocks if b < n_blocks]
    if not allowed or (block is not None and block not in allowed):
        pins = ", ".join(map(str, token.blocks))
        raise refused("block_not_allowed", f"token {token.name!r} may only train block(s) {pins}")
    return allowed
