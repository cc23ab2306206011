"""Bearer tokens: generated at random, shown once, stored only as SHA-256 hashes.

A token is 32 random bytes (256 bits), so a plain SHA-256 is enough to make a stolen ledger
useless for authentication; a slow password hash buys nothing against guessing 2^256 values.
"""

from __future__ import annotations

import hashlib
import secrets

from blocktrain.protocol.core.verdict import Verdict

TOKEN_PREFIX = "bt_"


def new_token() -> str:
    """A fresh token: the prefix and 43 URL-safe characters."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).hexdigest()


def bearer(authorization: str | None) -> str | Verdict:
    """The token of an `Authorization: Bearer <token>` header, or a refusal."""
    if not authorization or not authorization.strip():
        return Verdict.refuse(
            "missing_token",
            "send `Authorization: Bearer <token>`; create a token with `blocktrain token add`",
        )
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return Verdict.refuse("missing_token", "the Authorization header is not `Bearer <token>`")
    return value.strip()
