"""What the aggregator's routes share: accounting tags, and authentication and the rate limit
as FastAPI dependencies, each run before a route reads its body. A request whose token checks
out marks its connection a token holder's (`httpserve.mark_authenticated`: the listener keeps
it out of the anonymous pool)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Depends, Header, Path, Request

from blocktrain.httpserve import Scope, mark_authenticated
from blocktrain.protocol.service.aggregator_service import AggregatorService
from blocktrain.protocol.service.identity import Caller, check_may
from blocktrain.protocol.service.updates import PushContext
from blocktrain.protocol.store.ledger_schema import TokenRow

PUSH_PATH = re.compile(r"/v1/blocks/[^/]+/updates/?")
STREAM_PATH = re.compile(r"/v1/blocks/[^/]+/streams/?")


def _service(request: Request) -> AggregatorService:
    service: AggregatorService = request.app.state.service
    return service


def tag(
    request: Request, endpoint: str, block: int | None = None, worker: int | None = None
) -> None:
    """What the request is accounted under; the worker only once the token speaks for it."""
    request.state.endpoint = endpoint
    request.state.block = block
    request.state.worker = worker


def endpoint_of(scope: Scope) -> str:
    """The accounting name of a request the guard refused before any route ran."""
    path = scope.get("path", "")
    if PUSH_PATH.fullmatch(path):
        return "push"
    return "register" if path.rstrip("/") == "/v1/workers" else "other"


def authenticated(request: Request, authorization: str | None) -> TokenRow:
    """The request's token (`Admission.authenticate`, its failed checks counted against the
    client's address), its connection then marked a token holder's."""
    address = request.client.host if request.client else "unknown"
    token = _service(request).authenticate(authorization, address=address)
    mark_authenticated(request.scope)
    return token


def path_block(request: Request) -> int | None:
    return _int_or_none(request.path_params.get("block"))


def endpoint_token(endpoint: str) -> Any:
    """A dependency: tags the request for accounting, then checks its bearer token (and that a
    viewer token only watches)."""

    def dependency(request: Request, authorization: str | None = Header(None)) -> TokenRow:
        tag(request, endpoint, path_block(request))
        token = authenticated(request, authorization)
        _service(request).admit(token.id)
        check_may(token, endpoint)
        return token

    return Depends(dependency)


def endpoint_caller(endpoint: str) -> Any:
    """A dependency: the token and the worker it speaks for (X-Worker-Id)."""

    def dependency(
        request: Request,
        authorization: str | None = Header(None),
        x_worker_id: str | None = Header(None),
    ) -> Caller:
        tag(request, endpoint, path_block(request))
        worker = _int_or_none(request.path_params.get("worker_id"))
        if worker is not None:
            x_worker_id = str(worker)
        caller = _service(request).identify(
            authenticated(request, authorization), x_worker_id, endpoint
        )
        _service(request).admit(caller.token_id)
        tag(request, endpoint, path_block(request), caller.worker_id)
        return caller

    return Depends(dependency)


def push_context(
    request: Request,
    block: int = Path(ge=0),
    authorization: str | None = Header(None),
    x_worker_id: str | None = Header(None),
) -> PushContext:
    """The identity of a push, refused before its body is read."""
    tag(request, "push", block)
    ctx = _service(request).begin_push(
        token=authenticated(request, authorization), worker_header=x_worker_id, block=block
    )
    tag(request, "push", block, ctx.worker_id)
    return ctx


def errors_text(errors: Any) -> str:
    detail = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors
    )[:500]
    return detail or "invalid request"


def _int_or_none(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None
