"""Bearer tokens: random, hashed, parsed strictly."""

from __future__ import annotations

from blocktrain.protocol.core.verdict import Verdict
from blocktrain.protocol.store.tokens import TOKEN_PREFIX, bearer, hash_token, new_token


def test_tokens_are_random_and_long():
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(t.startswith(TOKEN_PREFIX) and len(t) >= 40 for t in tokens)


def test_hash_is_sha256_hex_and_not_the_token():
    t = new_token()
    h = hash_token(t)
    assert len(h) == 64 and int(h, 16) >= 0 and t not in h
    assert hash_token(t) == h and hash_token(t + "x") != h


def test_bearer_parsing():
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer   abc  ") == "abc"
    for header in (None, "", "   ", "Basic abc", "Bearer", "Bearer   "):
        verdict = bearer(header)
        assert isinstance(verdict, Verdict) and verdict.reason == "missing_token", header
