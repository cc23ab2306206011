"""The aggregator's HTTP API (FastAPI): thin routes over `service.AggregatorService`.

    POST   /v1/workers                   register; JSON {"block"?: int, "name"?: str}
    DELETE /v1/workers/{id}              leave (a stopping worker says goodbye)
    GET    /v1/config                    the run config and protocol settings
    GET    /v1/blocks/{b}                the open round's weights (safetensors body)
    GET    /v1/blocks/{b}/round          the open round (long poll with ?after=R&wait=S)
    POST   /v1/blocks/{b}/updates        push a delta (safetensors body)
    GET    /v1/status                    blocks, versions, rounds, participation, workers, bytes
    GET    /metrics                      Prometheus text format (no token)
    GET    /docs                         OpenAPI UI (no token)

Every other call needs `Authorization: Bearer <token>`. A refusal is a 4xx with
`{"accepted": false, "reason": CODE, "detail": TEXT}`; the codes are `verdict.REASONS`.
Build the app with `create_app(settings, storage=..., clock=...)`; nothing is built at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from blocktrain import __version__
from blocktrain.errors import Refused
from blocktrain.protocol import metrics as prometheus
from blocktrain.protocol.auth import Caller, refused
from blocktrain.protocol.effect import EffectProbe
from blocktrain.protocol.ledger_schema import TokenRow
from blocktrain.protocol.schemas import (
    ConfigOut,
    LeaveOut,
    RefusalOut,
    RegisterIn,
    RegisterOut,
    RoundOut,
    StatusOut,
    UpdateOut,
)
from blocktrain.protocol.service import AggregatorService, Clock, PushContext
from blocktrain.protocol.settings import AggregatorSettings
from blocktrain.protocol.status import snapshot
from blocktrain.protocol.storage import StateDir
from blocktrain.protocol.wire import CONTENT_TYPE

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
"""The longest a long poll is held."""


REFUSALS: dict[int | str, dict[str, Any]] = {
    code: {"model": RefusalOut} for code in (400, 401, 403, 404, 409, 410, 413, 415, 422)
}

SAFETENSORS_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
    }
}


# ---------------------------------------------------------------------------------------------
# Accounting tags and authentication, as FastAPI dependencies
# ---------------------------------------------------------------------------------------------


def _service(request: Request) -> AggregatorService:
    service: AggregatorService = request.app.state.service
    return service


def tag(
    request: Request, endpoint: str, block: int | None = None, worker: int | None = None
) -> None:
    request.state.endpoint = endpoint
    request.state.block = block
    request.state.worker = worker
    if not hasattr(request.state, "bytes_in"):
        request.state.bytes_in = _int_or_none(request.headers.get("content-length")) or 0


def path_block(request: Request) -> int | None:
    return _int_or_none(request.path_params.get("block"))


def endpoint_token(endpoint: str) -> Any:
    """A dependency: tags the request for accounting, then checks its bearer token."""

    def dependency(request: Request, authorization: str | None = Header(None)) -> TokenRow:
        tag(request, endpoint, path_block(request))
        return _service(request).authenticate(authorization)

    return Depends(dependency)


def endpoint_caller(endpoint: str) -> Any:
    """A dependency: the token and the worker it speaks for (X-Worker-Id)."""

    def dependency(
        request: Request,
        authorization: str | None = Header(None),
        x_worker_id: str | None = Header(None),
    ) -> Caller:
        worker = _int_or_none(request.path_params.get("worker_id"))
        tag(request, endpoint, path_block(request), worker)
        if worker is not None:
            x_worker_id = str(worker)
        return _service(request).identify(authorization, x_worker_id)

    return Depends(dependency)


def push_context(
    request: Request,
    block: int = Path(ge=0),
    authorization: str | None = Header(None),
    x_worker_id: str | None = Header(None),
    content_length: str | None = Header(None),
) -> PushContext:
    """Identity and declared size of a push, refused (with a ledger row) before its body
    is read."""
    tag(request, "push", block)
    ctx = _service(request).begin_push(
        authorization=authorization,
        worker_header=x_worker_id,
        block=block,
        content_length=_int_or_none(content_length),
    )
    tag(request, "push", block, ctx.worker_id)
    return ctx


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def create_app(
    settings: AggregatorSettings | None = None,
    *,
    storage: StateDir,
    clock: Clock = time.time,
    tick_interval_s: float = 0.1,
    probe: EffectProbe | None = None,
) -> FastAPI:
    """The aggregator over an initialised state folder. `clock` is injected so that tests can
    drive deadlines; `tick_interval_s` is how often deadlines are checked while served;
    `probe` judges each update by its effect (`effect.EffectProbe`)."""
    service = AggregatorService(settings, storage=storage, clock=clock)
    service.engine.use_probe(probe)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def ticker() -> None:
            while True:
                await asyncio.sleep(tick_interval_s)
                try:
                    await anyio.to_thread.run_sync(service.tick)
                except Exception:  # keep serving; the next tick retries
                    log.exception("tick failed")

        task = asyncio.create_task(ticker())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await anyio.to_thread.run_sync(service.flush_traffic)

    app = FastAPI(
        title="BlockTrain aggregator",
        version=__version__,
        lifespan=lifespan,
        description="Decentralised training of BlockTrain blocks: pull weights, push "
        "deltas, rounds with deadlines. See docs/protocol.md.",
    )
    app.state.service = service

    def refusal(request: Request, exc: Refused) -> JSONResponse:
        response = JSONResponse(
            {"accepted": False, "reason": exc.reason, "detail": exc.detail}, status_code=exc.status
        )
        _account(request, len(response.body))
        return response

    def _account(request: Request, bytes_out: int) -> None:
        endpoint = getattr(request.state, "endpoint", None)
        if endpoint is not None:
            service.traffic.account(
                endpoint,
                getattr(request.state, "block", None),
                getattr(request.state, "worker", None),
                getattr(request.state, "bytes_in", 0),
                bytes_out,
            )

    @app.exception_handler(Refused)
    async def on_refused(request: Request, exc: Refused) -> JSONResponse:
        return refusal(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        )[:500]
        return refusal(request, refused("bad_request", detail or "invalid request"))

    def json_response(request: Request, payload: Any, status: int = 200) -> JSONResponse:
        response = JSONResponse(payload, status_code=status)
        _account(request, len(response.body))
        return response

    # ------------------------------------------------------------------ workers

    @app.post(
        "/v1/workers",
        response_model=RegisterOut,
        responses=REFUSALS,
        summary="Register a worker; the aggregator assigns its block",
    )
    def register(
        request: Request,
        token: Annotated[TokenRow, endpoint_token("register")],
        body: RegisterIn | None = None,
    ) -> JSONResponse:
        tag(request, "register", None if body is None else body.block)
        out = service.register(
            token=token,
            block=None if body is None else body.block,
            name=None if body is None else body.name,
        )
        tag(request, "register", out["block"], out["worker_id"])
        return json_response(request, RegisterOut(**out).model_dump())

    @app.delete(
        "/v1/workers/{worker_id}",
        response_model=LeaveOut,
        responses=REFUSALS,
        summary="Leave: the block stops waiting for this worker",
    )
    def leave(
        request: Request,
        caller: Annotated[Caller, endpoint_caller("leave")],
        worker_id: int = Path(ge=0),
    ) -> JSONResponse:
        return json_response(request, LeaveOut(**service.leave(caller=caller)).model_dump())

    @app.get(
        "/v1/config",
        response_model=ConfigOut,
        responses=REFUSALS,
        summary="The run config, protocol settings and the blocks' tensor shapes",
    )
    def config(request: Request, _: Annotated[TokenRow, endpoint_token("config")]) -> JSONResponse:
        return json_response(request, ConfigOut(**service.config()).model_dump())

    # ------------------------------------------------------------------ blocks

    @app.get(
        "/v1/blocks/{block}",
        responses={
            200: {
                "content": {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
                "description": "the weights; __metadata__ holds block, version, round, deadline",
            },
            **REFUSALS,
        },
        summary="Pull the open round's weights (starts its clock)",
    )
    def pull(
        request: Request,
        caller: Annotated[Caller, endpoint_caller("pull")],
        block: int = Path(ge=0),
    ) -> Response:
        pulled = service.pull(caller=caller, block=block)
        view = pulled.view
        headers = {
            "X-Block": str(block),
            "X-Version": str(view.version),
            "X-Round": str(view.round),
            "X-Deadline": "" if view.deadline is None else f"{view.deadline:.6f}",
            "X-Deadline-In": "" if pulled.deadline_in is None else f"{pulled.deadline_in:.3f}",
        }
        _account(request, len(pulled.body))
        return Response(pulled.body, media_type=CONTENT_TYPE, headers=headers)

    @app.get(
        "/v1/blocks/{block}/round",
        response_model=RoundOut,
        responses=REFUSALS,
        summary="The open round; with after=R, wait up to `wait` s for a round > R",
    )
    async def round_info(
        request: Request,
        _: Annotated[TokenRow, endpoint_token("round")],
        block: int = Path(ge=0),
        after: int = Query(-1, ge=-1),
        wait: float = Query(0.0, ge=0.0),
    ) -> JSONResponse:
        info = service.peek(block)
        limit = time.monotonic() + min(wait, MAX_WAIT_S)
        while info["round"] <= after and not info["done"] and time.monotonic() < limit:
            await asyncio.sleep(0.05)
            info = service.peek(block)
        return json_response(request, RoundOut(**info).model_dump())

    @app.post(
        "/v1/blocks/{block}/updates",
        response_model=UpdateOut,
        responses=REFUSALS,
        openapi_extra=SAFETENSORS_BODY,
        summary="Push a delta: safetensors, __metadata__ block, base_version, round, tokens",
    )
    async def push(
        request: Request,
        ctx: Annotated[PushContext, Depends(push_context)],
        block: int = Path(ge=0),
    ) -> JSONResponse:
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > service.max_body:
                    request.state.bytes_in = size
                    raise service.refuse_push(
                        ctx,
                        "too_large",
                        f"the body exceeds the limit of {service.max_body} bytes",
                        size,
                    )
                chunks.append(chunk)
        except ClientDisconnect:
            raise service.refuse_push(
                ctx, "malformed", "the client sent a partial body and disconnected", size
            ) from None
        body = b"".join(chunks)
        request.state.bytes_in = len(body)
        out = await anyio.to_thread.run_sync(service.submit, ctx, body)
        return json_response(request, UpdateOut(**out).model_dump())

    # ------------------------------------------------------------------ status

    @app.get(
        "/v1/status",
        response_model=StatusOut,
        responses=REFUSALS,
        summary="Blocks, versions, rounds, participation, live workers, bytes moved",
    )
    def status(
        request: Request,
        _: Annotated[TokenRow, endpoint_token("status")],
        rounds: int = Query(20, ge=1, le=1_000_000),
    ) -> JSONResponse:
        return json_response(
            request, StatusOut(**snapshot(service, last_rounds=rounds)).model_dump()
        )

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    def metrics() -> PlainTextResponse:
        text = prometheus.exposition(
            snapshot(service, last_rounds=1), service.ledger.update_counts()
        )
        return PlainTextResponse(text, media_type=prometheus.CONTENT_TYPE)

    return app


def _int_or_none(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None
