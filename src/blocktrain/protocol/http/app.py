"""The aggregator's HTTP API (FastAPI): thin routes over
`service.aggregator_service.AggregatorService`.

    POST   /v1/workers                   register; JSON {"block"?: int, "name"?: str,
                                         "resume_worker_id"?: int}
    DELETE /v1/workers/{id}              leave (a stopping worker says goodbye)
    GET    /v1/config                    the run config and protocol settings
    GET    /v1/blocks/{b}                the open round's weights (safetensors body; with
                                         ?redirect=1, 303 to the version's immutable URL)
    GET    /v1/blocks/{b}/versions/{v}   a committed version (cacheable: ETag, Range; weights.py)
    GET    /v1/blocks/{b}/versions/{v}/delta   the same as a delta from a view held (core/pulls.py)
    GET    /v1/directory                 where each block's aggregator lives (peers.py)
    GET    /v1/blocks/{b}/round          the open round (long poll with ?after=R&wait=S)
    POST   /v1/blocks/{b}/updates        push a delta (safetensors body)
    POST   /v1/blocks/{b}/streams?round=R   route = relay: the round's stream, after its delta
    GET    /v1/blocks/{b}/streams        ... a stream of block b to train block b+1 on (long
                                         poll with ?wait=S; 204 when none came)
    GET    /v1/status                    blocks, versions, rounds, participation, workers, bytes
    GET    /v1/history                   the loss curve and each block's rounds (for the dashboard)
    GET    /dashboard                    the live dashboard, an HTML page (no token to load it)
    GET    /metrics                      Prometheus text format (a token with --private-status)
    GET    /docs                         OpenAPI UI (no token)

Every other call needs `Authorization: Bearer <token>`, checked before the body is read, and
is subject to the token's rate limit. A refusal is a 4xx with
`{"accepted": false, "reason": CODE, "detail": TEXT}`; the codes are `verdict.REASONS`.
`httpserve.HttpGuard` caps every body (pushes at `max_body_bytes`, JSON at a few KiB) before
the routes run. Build the app with `create_app(settings, storage=..., clock=..., limits=...)`;
nothing is built at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from blocktrain import __version__
from blocktrain.errors import Refused
from blocktrain.httpserve import BODY_BYTES, GUARD_REFUSAL, HttpGuard, Scope, read_body
from blocktrain.protocol.core.bodies import CONTENT_TYPE, version_path
from blocktrain.protocol.core.effect import EffectProbe
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import refused
from blocktrain.protocol.http import dashboard, relay, weights
from blocktrain.protocol.http import metrics as prometheus
from blocktrain.protocol.http.dependencies import (
    PUSH_PATH,
    STREAM_PATH,
    endpoint_caller,
    endpoint_of,
    endpoint_token,
    errors_text,
    push_context,
    tag,
)
from blocktrain.protocol.http.longpoll import MAX_WAIT_S, RoundSignal
from blocktrain.protocol.http.messages import (
    REFUSALS,
    REGISTER_BODY,
    SAFETENSORS_BODY,
    ConfigOut,
    LeaveOut,
    RegisterIn,
    RegisterOut,
    RoundOut,
    StatusOut,
    UpdateOut,
    binary_reply,
)
from blocktrain.protocol.http.peers import add_routes as add_directory
from blocktrain.protocol.http.peers import here
from blocktrain.protocol.http.status import snapshot
from blocktrain.protocol.http.weights import RangeNotSatisfiable
from blocktrain.protocol.service.access import AccessLimits, RateLimited
from blocktrain.protocol.service.aggregator_service import AggregatorService, Clock
from blocktrain.protocol.service.identity import Caller
from blocktrain.protocol.service.live_eval import ModelEval
from blocktrain.protocol.service.placement import Directory
from blocktrain.protocol.service.updates import PushContext
from blocktrain.protocol.store.ledger_schema import TokenRow
from blocktrain.protocol.store.storage import StateDir

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def create_app(
    settings: AggregatorSettings | None = None,
    *,
    storage: StateDir,
    clock: Clock = time.time,
    tick_interval_s: float = 0.1,
    limits: AccessLimits | None = None,
    probe: EffectProbe | None = None,
    directory: Directory | None = None,
    evaluator: ModelEval | None = None,
) -> FastAPI:
    """The aggregator over an initialised state folder. `clock` is injected so that tests can
    drive deadlines; serve it with `listener.run(app, sock, limits.http)` so that the connection
    limits match `limits`; `probe` judges each update by its effect; `evaluator` scores the
    assembled model every `live_eval_every` rounds."""
    service = AggregatorService(
        settings,
        storage=storage,
        clock=clock,
        limits=limits,
        directory=directory,
        evaluator=evaluator,
    )
    service.engine.use_probe(probe)
    rounds = RoundSignal()
    service.engine.on_commit.append(lambda event: rounds.notify(event.closed.block))

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
            await anyio.to_thread.run_sync(service.close)

    app = FastAPI(
        title="BlockTrain aggregator",
        version=__version__,
        lifespan=lifespan,
        description="Decentralised training of BlockTrain blocks: pull weights, push "
        "deltas, rounds with deadlines. See docs/protocol.md.",
    )
    app.state.service = service

    def push_cap(scope: Scope) -> int:
        if scope.get("method") == "POST" and PUSH_PATH.fullmatch(scope.get("path", "")):
            return service.max_body
        if scope.get("method") == "POST" and STREAM_PATH.fullmatch(scope.get("path", "")):
            return max(service.max_stream_body, service.limits.http.max_body)
        return service.limits.http.max_body

    app.add_middleware(
        HttpGuard,
        limits=service.limits.http,
        body_limit=push_cap,
        error_body=lambda code, detail: {"accepted": False, "reason": code, "detail": detail},
        on_refuse=lambda scope, code: service.traffic.refused(endpoint_of(scope), code),
    )

    def refusal(request: Request, exc: Refused) -> JSONResponse:
        headers = None
        if isinstance(exc, RateLimited):
            headers = {"Retry-After": str(max(1, int(exc.retry_after_s + 0.999)))}
        elif isinstance(exc, RangeNotSatisfiable):
            headers = {"Content-Range": f"bytes */{exc.size}"}
        response = JSONResponse(
            {"accepted": False, "reason": exc.reason, "detail": exc.detail},
            status_code=exc.status,
            headers=headers,
        )
        if not hasattr(request.state, GUARD_REFUSAL):  # the guard answers, and counts it
            service.traffic.refused(getattr(request.state, "endpoint", "other"), exc.reason)
        _account(request, len(response.body))
        return response

    def _account(request: Request, bytes_out: int) -> None:
        endpoint = getattr(request.state, "endpoint", None)
        if endpoint is not None:
            service.traffic.account(
                endpoint,
                getattr(request.state, "block", None),
                getattr(request.state, "worker", None),
                getattr(request.state, BODY_BYTES, 0),
                bytes_out,
            )

    @app.exception_handler(Refused)
    async def on_refused(request: Request, exc: Refused) -> JSONResponse:
        return refusal(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refusal(request, refused("bad_request", errors_text(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # FastAPI's own: a JSON body it cannot parse
            return refusal(request, refused("bad_request", str(exc.detail)))
        return await http_exception_handler(request, exc)

    def json_response(request: Request, payload: Any, status: int = 200) -> JSONResponse:
        response = JSONResponse(payload, status_code=status)
        _account(request, len(response.body))
        return response

    # ------------------------------------------------------------------ workers

    @app.post(
        "/v1/workers",
        response_model=RegisterOut,
        responses=REFUSALS,
        openapi_extra=REGISTER_BODY,
        summary="Register a worker; the aggregator assigns its block",
    )
    async def register(
        request: Request, token: Annotated[TokenRow, endpoint_token("register")]
    ) -> JSONResponse:
        # the body is read here, after the token: FastAPI reads a declared body parameter
        # before it runs any dependency
        try:
            raw = await request.body()
            body = RegisterIn.model_validate_json(raw) if raw.strip() else None
        except ValidationError as exc:
            raise refused("bad_request", errors_text(exc.errors())) from None
        tag(request, "register", None if body is None else body.block)
        out = await anyio.to_thread.run_sync(
            lambda: service.register(
                token=token,
                block=None if body is None else body.block,
                name=None if body is None else body.name,
                resume=None if body is None else body.resume_worker_id,
            )
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
        where = service.directory.to_dict(here(request))
        return json_response(request, ConfigOut(**service.config(), directory=where).model_dump())

    # ------------------------------------------------------------------ blocks

    @app.get(
        "/v1/blocks/{block}",
        responses={
            **binary_reply("the weights; __metadata__ holds block, version, round, deadline"),
            **REFUSALS,
        },
        summary="Pull the open round's weights (starts its clock)",
    )
    def pull(
        request: Request,
        caller: Annotated[Caller, endpoint_caller("pull")],
        block: int = Path(ge=0),
        redirect: bool = Query(False, description="303 to the version's immutable URL"),
    ) -> Response:
        pulled = service.pull(caller=caller, block=block, with_body=not redirect)
        view = pulled.view
        headers = {
            "X-Block": str(block),
            "X-Version": str(view.version),
            "X-Round": str(view.round),
            "X-Deadline": "" if view.deadline is None else f"{view.deadline:.6f}",
            "X-Deadline-In": "" if pulled.deadline_in is None else f"{pulled.deadline_in:.3f}",
            "X-Local-Steps": str(pulled.local_steps),  # this worker's H (pacing)
            "X-Weights-Url": version_path(block, view.version),
            "Cache-Control": "no-store",  # it records a pull: every one must reach us
        }
        _account(request, len(pulled.body))
        if redirect:
            headers["Location"] = headers["X-Weights-Url"]
            return Response(status_code=303, headers=headers)
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
        changed = rounds.event(block)
        info = service.peek(block)
        limit = time.monotonic() + min(wait, MAX_WAIT_S)
        while info["round"] <= after and not info["done"] and time.monotonic() < limit:
            # woken when a round of the block closes (re-read at least once a second)
            await rounds.wait(changed, min(1.0, limit - time.monotonic()))
            changed = rounds.event(block)
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
        try:  # the guard caps the size (and the time) while streaming
            body = await read_body(request.scope, request.stream())
        except ClientDisconnect:
            size = getattr(request.state, BODY_BYTES, 0)
            reason, detail = getattr(request.state, GUARD_REFUSAL, ("", ""))
            if reason:  # the token is known: the refusal gets its ledger row
                raise service.refuse_push(ctx, reason, detail, size) from None
            raise service.refuse_push(
                ctx, "malformed", "the client sent a partial body and disconnected", size
            ) from None
        out = await anyio.to_thread.run_sync(service.submit, ctx, body)
        return json_response(request, UpdateOut(**out).model_dump())

    relay.add_routes(app, service, _account, json_response, REFUSALS)

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

    def metrics() -> PlainTextResponse:
        text = prometheus.exposition(
            snapshot(service, last_rounds=1), service.ledger.update_counts()
        )
        return PlainTextResponse(text, media_type=prometheus.CONTENT_TYPE)

    def private_metrics(
        _: Annotated[TokenRow, endpoint_token("metrics")],
    ) -> PlainTextResponse:
        return metrics()

    app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses=REFUSALS if service.limits.private_status else None,
        summary="Prometheus metrics" + (" (a token)" if service.limits.private_status else ""),
    )(private_metrics if service.limits.private_status else metrics)

    dashboard.add_routes(app, service, endpoint_token, json_response, REFUSALS)
    app.state.versions = weights.add_routes(app, service, endpoint_token, _account, REFUSALS)
    add_directory(app, service.directory, endpoint_token, json_response, REFUSALS)
    return app
