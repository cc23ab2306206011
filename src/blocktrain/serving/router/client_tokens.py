"""The router's client tokens (`serve --set tokens_file=PATH`): docs/serving.md, "Trust: authentication
and limits". Tokens live in a file, never on the command line (where `ps` shows them); the router
keeps only their SHA-256 digests; a missing and a wrong token get the same 401, and failed checks
from one address or its network are limited (`httpserve.FailedAuth`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from blocktrain.errors import ConfigError
from blocktrain.httpserve import FailedAuth, mark_authenticated
from blocktrain.serving.router.limits import CLIENT_TOKEN, client_address
from blocktrain.serving.shared.auth import MIN_SECRET_CHARS
from blocktrain.serving.shared.serving_errors import TooManyRequests, Unauthorized, send_error

PROTECTED_PREFIX = "/v1/"
"""What needs a token: the API; liveness and readiness probes do not."""


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).hexdigest()


def load_tokens(path: str | None) -> frozenset[str]:
    """The digests of the tokens in `path` (one a line; blank lines and `#` comments skipped;
    each at least 16 characters); empty without a path. A file that cannot be read, or holds
    no token, is a ConfigError."""
    if path is None:
        return frozenset()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--set tokens_file={path}: cannot read it ({exc})") from None
    tokens = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if not tokens:
        raise ConfigError(f"--set tokens_file={path} holds no token (one a line)")
    for n, token in enumerate(tokens, 1):
        if len(token) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"--set tokens_file={path}: token {n} holds {len(token)} characters; use at least "
                f"{MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)"
            )
    return frozenset(digest(t) for t in tokens)


class RequireToken:
    """ASGI middleware: a `/v1/` request must present one of `digests` (none: the router is
    open). A valid token is put in the scope's state (`CLIENT_TOKEN`, a prefix of its digest:
    whom the work limits count) and its connection marked a token holder's."""

    def __init__(self, app: ASGIApp, digests: frozenset[str], failures: FailedAuth) -> None:
        self.app = app
        self.digests = digests
        self.failures = failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            not self.digests
            or scope["type"] != "http"
            or not scope["path"].startswith(PROTECTED_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        address = client_address(scope)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.decode("latin-1").strip().partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if token and (wait := self.failures.wait(address)):
            await send_error(
                send,
                TooManyRequests(self.failures.refusal(address, wait), retry_after_s=wait),
                scope,
            )
            return
        key = digest(token) if token else None
        if key in self.digests:
            scope.setdefault("state", {})[CLIENT_TOKEN] = key[:16]
            mark_authenticated(scope)
            await self.app(scope, receive, send)
            return
        if token:
            self.failures.failed(address)
        err = Unauthorized(
            "this router takes requests with one of its tokens: send it as 'Authorization: "
            "Bearer TOKEN' (the OpenAI client's api_key); ask the router's operator for one",
            code="invalid_api_key",
        )
        await send_error(send, err, scope)
