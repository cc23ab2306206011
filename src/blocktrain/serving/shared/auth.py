"""Router <-> host authentication: one shared secret, presented as `Authorization: Bearer
SECRET` and checked before a request's body is read.

The secret comes from a file (`--secret-file`) or the environment (`BLOCKTRAIN_SERVE_SECRET`),
never from the command line alone, where `ps` would show it. Hosts compare SHA-256 digests
with `hmac.compare_digest`, so the comparison takes the same time whatever the guess (and
leaks not even the secret's length).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from blocktrain.errors import ConfigError
from blocktrain.httpserve import mark_authenticated
from blocktrain.serving.shared.serving_errors import Unauthorized, send_error

SECRET_ENV = "BLOCKTRAIN_SERVE_SECRET"
MIN_SECRET_CHARS = 16
OPEN_PATHS = frozenset({"/healthz"})
"""Paths a host answers without the secret: liveness only. `/v1/info` is not among them: it
shows the run's configuration and the chain's layout, and only the router needs it."""


def load_secret(secret_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The shared secret from `secret_file`, else from $BLOCKTRAIN_SERVE_SECRET, else None.
    Surrounding whitespace (a trailing newline) is dropped; a secret under 16 characters is a
    ConfigError, as is a file that cannot be read."""
    env = os.environ if environ is None else environ
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--secret-file {secret_file}: cannot read it ({exc})") from None
        where = f"--secret-file {secret_file}"
    elif env.get(SECRET_ENV) is not None:
        secret, where = env[SECRET_ENV].strip(), f"${SECRET_ENV}"
    else:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{where}: the secret holds {len(secret)} characters; use at least "
            f"{MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def auth_headers(secret: str | None) -> dict[str, str]:
    """The headers a router (or a host forwarding along --next) sends to a host."""
    return {} if secret is None else {"authorization": f"Bearer {secret}"}


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class RequireSecret:
    """ASGI middleware: every HTTP request outside OPEN_PATHS must carry the secret, checked
    on the headers alone, so an unauthenticated body is never read. `secret` None: open."""

    def __init__(self, app: ASGIApp, secret: str | None) -> None:
        self.app = app
        self._expected = None if secret is None else _digest(f"Bearer {secret}".encode())

    def allowed(self, scope: Scope) -> bool:
        if self._expected is None or scope["path"] in OPEN_PATHS:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(_digest(given), self._expected):
            return False
        mark_authenticated(scope)  # the router's connection: out of the anonymous pool
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        err = Unauthorized(
            "this block host takes work only from its router: send the shared secret as "
            f"'Authorization: Bearer SECRET' (--secret-file or ${SECRET_ENV})"
        )
        await send_error(send, err, scope)
