"""route = relay: a worker of block b pushes its round's stream after its delta, and a worker
of block b+1 takes one to train on (a long poll, woken when a stream comes or a round closes).

    POST /v1/blocks/{b}/streams?round=R   the round's stream (bytes, 8-bit features)
    GET  /v1/blocks/{b}/streams?wait=S    a stream of block b (204 when none came)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

import anyio
from fastapi import FastAPI, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from blocktrain.httpserve import GUARD_REFUSAL, read_body
from blocktrain.protocol.core.bodies import CONTENT_TYPE
from blocktrain.protocol.core.verdict import refused
from blocktrain.protocol.http.dependencies import endpoint_caller, endpoint_token
from blocktrain.protocol.http.longpoll import MAX_WAIT_S, RoundSignal
from blocktrain.protocol.http.messages import SAFETENSORS_BODY, StreamOut, binary_reply
from blocktrain.protocol.service.aggregator_service import AggregatorService
from blocktrain.protocol.service.identity import Caller
from blocktrain.protocol.store.ledger_schema import TokenRow


def add_routes(
    app: FastAPI,
    service: AggregatorService,
    account: Callable[[Request, int], None],
    respond: Callable[[Request, Any], JSONResponse],
    refusals: dict[int | str, dict[str, Any]],
) -> None:
    streams = RoundSignal()
    service.on_stream.append(streams.notify)
    service.engine.on_commit.append(lambda event: streams.notify(event.closed.block))

    @app.post(
        "/v1/blocks/{block}/streams",
        response_model=StreamOut,
        responses=refusals,
        openapi_extra=SAFETENSORS_BODY,
        summary="route = relay: push the round's stream (bytes, 8-bit features), after its delta",
    )
    async def push_stream(
        request: Request,
        caller: Annotated[Caller, endpoint_caller("stream_push")],
        block: int = Path(ge=0),
        round: int = Query(ge=0),
    ) -> JSONResponse:
        try:  # the guard caps the size (and the time) while streaming
            body = await read_body(request.scope, request.stream())
        except ClientDisconnect:
            reason, detail = getattr(request.state, GUARD_REFUSAL, ("", ""))
            raise refused(reason or "malformed", detail or "a partial body") from None
        out = await anyio.to_thread.run_sync(
            lambda: service.put_stream(caller=caller, block=block, round=round, body=body)
        )
        return respond(request, StreamOut(**out).model_dump())

    @app.get(
        "/v1/blocks/{block}/streams",
        responses={
            **binary_reply("a stream; X-Relay-Round, X-Relay-Worker and X-Relay-Steps"),
            204: {"description": "no stream came within `wait` seconds"},
            **refusals,
        },
        summary="route = relay: a stream of block b to train block b+1 on (long poll)",
    )
    async def take_stream(
        request: Request,
        token: Annotated[TokenRow, endpoint_token("stream_take")],
        block: int = Path(ge=0),
        wait: float = Query(0.0, ge=0.0),
        x_worker_id: str | None = Header(None),
    ) -> Response:
        taker = (token.id, x_worker_id or "")
        limit = time.monotonic() + min(wait, MAX_WAIT_S)
        while True:
            changed = streams.event(block)
            relayed = service.take_stream(taker=taker, block=block)
            if relayed is not None or time.monotonic() >= limit:
                break
            await streams.wait(changed, min(1.0, limit - time.monotonic()))
        if relayed is None:
            account(request, 0)
            return Response(status_code=204)
        account(request, len(relayed.body))
        headers = {
            "X-Relay-Round": str(relayed.round),
            "X-Relay-Worker": str(relayed.worker),
            "X-Relay-Steps": str(relayed.steps),
            "Cache-Control": "no-store",
        }
        return Response(relayed.body, media_type=CONTENT_TYPE, headers=headers)
