"""The router's HTTP app over `router.chain_router.Router` (docs/serving.md): `/v1/generate`,
the OpenAI routes (openai_api.py), `/v1/models`, `/healthz`, `/readyz`; errors as OpenAI JSON."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from blocktrain.httpserve import FailedAuth, HttpGuard, Limits
from blocktrain.model import utf8
from blocktrain.serving.openai.openai_api import add_openai_routes
from blocktrain.serving.router.chain_router import Router
from blocktrain.serving.router.client_tokens import RequireToken
from blocktrain.serving.router.generate_schemas import (
    GenerateRequest,
    GenerateResponse,
    Timing,
)
from blocktrain.serving.router.limits import (
    CLIENT_GONE,
    ClientGone,
    RateLimit,
    holder_of,
    per_minute,
    while_connected,
)
from blocktrain.serving.router.readiness import Readiness
from blocktrain.serving.router.router_settings import RouterSettings
from blocktrain.serving.router.traversal import (
    ChainStats,
)
from blocktrain.serving.shared.serving_errors import BadRequest, ServingError, error_body
from blocktrain.serving.shared.transport import make_client

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    param = loc[0] if loc else None
    if first.get("type") == "extra_forbidden":
        msg = "unknown parameter"
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), param


def create_app(
    settings: RouterSettings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The router app; `transport` (tests) replaces the network to the hosts, `clock` the
    time the rate limit counts in."""
    client = make_client(
        timeout_s=settings.timeout_s,
        hop_ms=settings.hop_ms,
        transport=transport,
        secret=settings.secret,
        ca_cert=settings.ca_cert,
    )
    router = Router(settings, client)
    readiness = Readiness(router)
    limiter = per_minute(settings.rate_per_minute, clock) if settings.rate_per_minute else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="BlockTrain router", lifespan=lifespan)
    app.state.router = router
    limits = Limits(max_body=settings.max_body_bytes)
    # The guard outside the token check and the rate limit: it holds their 429s
    # (Limits.tarpit_s). The token before the rate: a request without one costs nothing more.
    app.add_middleware(RateLimit, limiter=limiter)
    app.add_middleware(RequireToken, digests=settings.tokens, failures=FailedAuth(limits, clock))
    app.add_middleware(HttpGuard, limits=limits, error_body=error_body)

    @app.exception_handler(ServingError)
    async def serving_error(_: Request, exc: ServingError) -> JSONResponse:
        exc = router.failed(exc)
        if exc.status >= 500:
            log.warning("%s", exc.message)
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.http_headers())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse, an unknown path) in the OpenAI shape.
        err = BadRequest(str(exc.detail), code="invalid_request", status=exc.status_code)
        return JSONResponse(err.to_json(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(BadRequest(message, param=param).to_json(), status_code=400)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "hosts": list(settings.hosts)}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        # 200 only when a 1-byte sweep gets through every model's chain (router/readiness.py).
        ready, body = await readiness.check()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = await router.directory.models()
        return {
            "object": "list",
            "data": [m.describe() for m in served.values()],
            "unavailable": router.directory.unavailable,
        }

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest, request: Request) -> GenerateResponse | Response:
        t0 = time.perf_counter()
        client, address = holder_of(request.scope)
        job = await router.job(
            model=req.model,
            prompt=req.prompt,
            n_bytes=req.max_bytes,
            param="max_bytes",
            req=req,
            client=client,
            address=address,
        )
        stats = ChainStats()

        async def collect() -> list[torch.Tensor]:
            return [piece async for piece in router.stream(job, stats)]

        try:
            pieces = await while_connected(request.receive, collect())
        except ClientGone:
            return Response(status_code=CLIENT_GONE)  # nobody reads it
        finally:
            router.done(job)
        data = bytes(torch.cat(pieces, dim=1)[0].tolist())
        if job.sampling.utf8:  # a last character cut short by max_bytes is not text
            data = data[: utf8.complete_length(data, utf8.state_after(job.prompt))]
        return GenerateResponse(
            model=job.model.name,
            kind=job.model.kind,
            text=data.decode("utf-8", "replace"),
            bytes=list(data),
            seed=job.seed,
            prompt_bytes=len(job.prompt),
            output_bytes=len(data),
            traversals=stats.traversals,
            hosts=job.model.route,
            timing=Timing(
                total_s=time.perf_counter() - t0,
                chain_s=stats.chain_s,
                host_compute_s=stats.host_compute_s,
            ),
        )

    add_openai_routes(app, router)
    return app
