"""The serving layer's errors (a branch of `blocktrain.errors`): each carries the HTTP status it
maps to, a machine-readable `code` and, for host errors, the `host` it concerns
(docs/serving.md, "Errors"). Hosts relay the errors of hosts behind them unchanged, so the
router names the host that actually failed.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.types import Scope, Send

from blocktrain.errors import BlockTrainError


class ServingError(BlockTrainError):
    """Base of the serving layer's errors."""

    status = 500
    code = "serving_error"
    kind = "server_error"

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        code: str | None = None,
        status: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.host = host
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def http_headers(self) -> dict[str, str]:
        """Headers the error's response carries beside its JSON body."""
        return {}

    def to_json(self) -> dict[str, Any]:
        """The OpenAI-style error body: {"error": {message, type, param, code, host}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
                "host": self.host,
            }
        }


class BadRequest(ServingError):
    status = 400
    code = "invalid_value"
    kind = "invalid_request_error"


def reversed_stack_sweep(model: str) -> BadRequest:
    """The refusal of a sweep (exit = sampler) asked of an intervals = reversed stack: its
    sweep would start at the last block. The router refuses it before any work, and a host
    refuses a sweep message that reaches it all the same."""
    return BadRequest(
        f"{model!r} is an intervals = reversed stack: its sweep starts at the last block, and "
        "the chain runs the blocks in order; ask for exit = head",
        param="exit",
    )


class Unauthorized(ServingError):
    status = 401
    code = "unauthorized"
    kind = "authentication_error"

    def http_headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}


class TooManyRequests(ServingError):
    status = 429
    code = "rate_limited"
    kind = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s

    def http_headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}


class HostError(ServingError):
    """A host of the chain failed; `host` is its URL."""

    status = 502
    code = "host_error"


class HostUnavailable(HostError):
    status = 503
    code = "host_unavailable"
    kind = "service_unavailable"


class HostTimeout(HostError):
    status = 504
    code = "host_timeout"
    kind = "service_unavailable"


class HostRefused(HostError):
    status = 409
    code = "host_refused"


class SessionLost(HostRefused):
    code = "session_lost"


_BY_CODE: dict[str, type[ServingError]] = {
    cls.code: cls
    for cls in (BadRequest, HostError, HostUnavailable, HostTimeout, HostRefused, SessionLost)
}


def error_from_json(status: int, body: Any, *, default_host: str) -> ServingError:
    """Rebuild the error a host answered with (its JSON body), keeping its status and the host
    it names; a body that is not ours becomes a HostRefused naming `default_host`."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return HostRefused(
            f"host {default_host} answered HTTP {status}: {str(body)[:200]}",
            host=default_host,
            status=status,
        )
    code = err.get("code") if isinstance(err.get("code"), str) else None
    cls = _BY_CODE.get(code or "", HostRefused)
    if cls is BadRequest:  # a request the router let through but a host refused
        cls = HostRefused
    host = err.get("host") if isinstance(err.get("host"), str) else default_host
    return cls(err["message"], host=host, code=code, status=status)


def error_body(code: str, detail: str) -> dict[str, Any]:
    """The JSON of the HTTP guard's own refusals (httpserve.HttpGuard: a body over the cap, an
    absurd Content-Length, a slow client), in the OpenAI shape of every other error."""
    return BadRequest(detail, code=code).to_json()


def has_body(scope: Scope) -> bool:
    """Whether a request declares a body (a Content-Length above 0, or chunked)."""
    for k, v in scope.get("headers", []):
        name = k.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and v.strip() != b"0"):
            return True
    return False


async def send_error(send: Send, err: ServingError, scope: Scope | None = None) -> None:
    """Answer an ASGI request with `err` as JSON, from a middleware, before any route and
    without reading the body. With `scope`, a request that declares a body is answered
    `Connection: close`, so the server closes instead of draining a body nobody reads, as slowly
    as the client cares to send it."""
    body = json.dumps(err.to_json()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in err.http_headers().items()),
    ]
    if scope is not None and has_body(scope):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
