"""The block host's HTTP app: the routes (`/v1/sweep`, `/v1/sweeps`, `/v1/stage`, `/v1/release`,
`/v1/info` behind the secret, `/healthz` open) over `block_host.BlockHost`, the shared secret,
body limits, and errors as JSON (docs/serving.md, "The wire").
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from blocktrain.httpserve import HttpGuard, Limits
from blocktrain.serving.host.block_host import BlockHost
from blocktrain.serving.host.host_settings import HostSettings
from blocktrain.serving.host.loading import HostedModel, load_hosted_model
from blocktrain.serving.shared.auth import RequireSecret
from blocktrain.serving.shared.coalesce import host_sweeps
from blocktrain.serving.shared.serving_errors import BadRequest, ServingError, error_body
from blocktrain.serving.shared.transport import make_client
from blocktrain.serving.shared.wire import (
    CONTENT_TYPE,
    TRACE_HEADER,
    Release,
    TraceEntry,
    trace_to_header,
)

log = logging.getLogger(__name__)


def create_app(
    settings: HostSettings,
    *,
    models: list[HostedModel] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """A block host. Loads its blocks/stages from the run folders in `settings` unless `models`
    are given; `transport` (tests) replaces the network to the next host."""
    if models is None:
        models = [
            load_hosted_model(src, list(settings.parts), settings.device) for src in settings.models
        ]
    client = make_client(
        timeout_s=settings.timeout_s,
        hop_ms=settings.hop_ms,
        transport=transport,
        secret=settings.secret,
        ca_cert=settings.ca_cert,
    )
    host = BlockHost(settings, {m.name: m for m in models}, client, clock)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="BlockTrain block host", lifespan=lifespan)
    app.state.host = host
    # The body cap (declared or chunked) holds before the route reads a byte; outside it, a
    # caller without the secret is answered before anything else looks at its request.
    app.add_middleware(
        HttpGuard, limits=Limits(max_body=settings.max_body_bytes), error_body=error_body
    )
    app.add_middleware(RequireSecret, secret=settings.secret)

    @app.exception_handler(ServingError)
    async def serving_error(_: Request, exc: ServingError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("%s", exc.message)
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.http_headers())

    def answer(result: tuple[bytes, list[TraceEntry]]) -> Response:
        body, trace = result
        return Response(
            body, media_type=CONTENT_TYPE, headers={TRACE_HEADER: trace_to_header(trace)}
        )

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "host": settings.public_url}

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        return host.info()

    @app.post("/v1/sweep")
    async def sweep(request: Request) -> Response:
        return answer(await host.sweep(await request.body()))

    @app.post("/v1/sweeps")
    async def sweeps(request: Request) -> Response:
        body = await host_sweeps(host.sweep, await request.body(), settings.max_batch)
        return answer((body, []))

    @app.post("/v1/stage")
    async def stage(request: Request) -> Response:
        return answer(await host.stage(await request.body()))

    @app.post("/v1/release")
    async def release(request: Request) -> dict[str, bool]:
        try:
            req = Release.model_validate_json(await request.body())
        except ValidationError as exc:
            raise BadRequest(f"not a release request: {exc.errors()[0]['msg']}") from None
        return {"released": host.sessions.release(req.model, req.session)}

    return app
