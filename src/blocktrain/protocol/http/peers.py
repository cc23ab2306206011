"""GET /v1/directory: where each block's aggregator lives (`service.placement.Directory`, the
blocks this aggregator serves and its peers), mapped to URLs as the request reached this
aggregator.

    GET /v1/directory    {"blocks": {"0": URL, ...}, "served": [0]}   (also in /v1/config)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from blocktrain.protocol.service.placement import Directory


def here(request: Request) -> str:
    """The URL this request came in on: how the caller reaches this aggregator."""
    return str(request.base_url).rstrip("/")


def add_routes(
    app: FastAPI,
    directory: Directory,
    token: Callable[[str], Any],
    respond: Callable[[Request, Any], JSONResponse],
    refusals: dict[int | str, dict[str, Any]],
) -> None:
    """GET /v1/directory, behind `token(endpoint)` (the app's authentication dependency)."""
    authenticated = token("directory")  # a default: see dashboard.add_routes

    @app.get("/v1/directory", responses=refusals, summary="Where each block's aggregator lives")
    def get_directory(request: Request, _: Any = authenticated) -> JSONResponse:
        return respond(request, directory.to_dict(here(request)))
