"""Committed versions of a block's weights at immutable URLs, for plain HTTP caches and CDNs
(docs/protocol.md, Pulls through a cache).

    GET /v1/blocks/{b}/versions/{v}     version v of block b in the wire dtype (safetensors)
    GET /v1/blocks/{b}/versions/{v}/delta?wire=CODEC[&base=VIEW]
                                        version v as a delta (core/pulls.py)

A version never changes, so its answer is `immutable` with a strong `ETag` (304 on
`If-None-Match`, 206 on one `Range`); `unknown_version` is 404, one pruned by `keep_versions`
`version_gone` (410). The answer is `private` behind the token, or `public` without one under
`--public-weights`, so that a CDN may serve every worker. The round's pull with `?redirect=1`
records the pull and answers 303 to the version's URL."""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.responses import Response

from blocktrain.errors import ProtocolError, Refused
from blocktrain.protocol.core.bodies import CONTENT_TYPE, encode
from blocktrain.protocol.core.delta_wire import FULL, pull_codec
from blocktrain.protocol.core.events import Committed
from blocktrain.protocol.core.pulls import Commits, DeltaBody, Views
from blocktrain.protocol.core.verdict import refused
from blocktrain.protocol.http.dependencies import tag
from blocktrain.protocol.http.messages import BINARY
from blocktrain.protocol.service.aggregator_service import AggregatorService

IMMUTABLE = "max-age=31536000, immutable"
DELTA_PATH = "/v1/blocks/{block}/versions/{version}/delta"
CACHED_VERSIONS = 4
"""Encoded bodies kept in memory (the versions workers pull are the newest of each block)."""
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class VersionBody:
    body: bytes
    etag: str
    """A strong entity tag: the body's SHA-256, quoted."""


class RangeNotSatisfiable(Refused):
    """416 `bad_range`, answered with `Content-Range: bytes */SIZE`."""

    def __init__(self, detail: str, size: int) -> None:
        base = refused("bad_range", detail)
        super().__init__(base.reason, base.detail, base.status)
        self.size = size


class Versions:
    """The encoded bodies of committed versions, a few kept in memory."""

    def __init__(self, service: AggregatorService, keep: int = CACHED_VERSIONS) -> None:
        self.service = service
        self.keep = keep
        self._bodies: OrderedDict[tuple[int, int], VersionBody] = OrderedDict()
        settings = service.settings
        self.views = Views(settings.wire_dtype)
        codec = settings.commit_codec
        self.commits = None if codec is None else Commits(codec)
        """Exact pulls: the last commits, which are the deltas."""
        self._lock = threading.Lock()
        service.engine.on_commit.append(self._remember_step)

    def _remember_step(self, event: Committed) -> None:
        """Exact pulls: the commit's step is the delta of its version from the one before."""
        if self.commits is not None and event.step is not None:
            self.commits.add(event.closed.block, event.closed.new_version, event.step)

    def get(self, block: int, version: int) -> VersionBody:
        newest = self._published(block, version)
        key = (block, version)
        with self._lock:
            cached = self._bodies.get(key)
            if cached is not None:
                self._bodies.move_to_end(key)
                return cached
        weights = newest if newest is not None else self._load(block, version)
        out = self._encode(block, version, weights)
        with self._lock:
            self._bodies[key] = out
            while len(self._bodies) > self.keep:
                self._bodies.popitem(last=False)
        return out

    def weights(self, block: int, version: int) -> dict[str, torch.Tensor]:
        """A committed version's fp32 weights (unknown_version: not reached yet; version_gone:
        pruned)."""
        newest = self._published(block, version)
        return newest if newest is not None else self._load(block, version)

    def _published(self, block: int, version: int) -> dict[str, torch.Tensor] | None:
        """The block's weights when `version` is its newest; None for an older version still
        on disk; unknown_version or version_gone otherwise."""
        current, weights = self._current(block, version)
        if version == current:
            return weights
        if not self.service.storage.has_tensors(block, version):
            raise self._gone(block, version)
        return None

    def _current(self, block: int, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The block's published version and its weights, together; unknown_version when
        `version` is past it."""
        service = self.service
        service.check_block(block)
        with service.lock:
            st = service.blocks[block]
            current, weights = st.rounds.version, st.weights
        if version > current:
            raise refused("unknown_version", f"block {block} is at version {current}")
        return current, weights

    def _load(self, block: int, version: int) -> dict[str, torch.Tensor]:
        try:
            return self.service.storage.load_tensors(block, version)
        except ProtocolError:  # pruned meanwhile
            raise self._gone(block, version) from None

    def delta(self, block: int, version: int, base: str | None, wire: str) -> DeltaBody:
        """Version `version` as a delta in `wire`, the aggregator's pull wire (wrong_wire
        otherwise): under exact pulls its commit, whatever `base` (version_gone when it is not
        held); else a delta from view `base` (unknown_base when it holds no such view)."""
        pulls = self.service.settings.pulls
        if wire != pulls:
            raise refused(
                "wrong_wire",
                f"this aggregator sends pulls as {pulls!r} (`pull_wire` in /v1/config), not "
                f"{wire[:20]!r}",
            )
        codec = pull_codec(wire)
        assert codec is not None  # "full" is no codec, and a wire equal to it was refused
        if self.commits is not None:  # the commit is the delta; its weights may be pruned
            self._current(block, version)
            return self.commits.get(block, version)
        if base is None:
            raise refused(
                "unknown_base",
                "this aggregator's pulls are not exact: name the view held (base=VIEW)",
            )
        return self.views.delta(block, version, self.weights(block, version), base, codec)

    def _encode(self, block: int, version: int, weights: dict[str, torch.Tensor]) -> VersionBody:
        settings = self.service.settings
        meta = {
            "block": block,
            "version": version,
            "dtype": settings.wire_dtype,
            "local_steps": settings.local_steps,
        }
        body = encode(weights, meta, settings.wire_dtype)
        if settings.pulls != FULL and self.commits is None:  # the next may come from its view
            self.views.whole(block, version, weights)
        return VersionBody(body, f'"{hashlib.sha256(body).hexdigest()}"')

    def _gone(self, block: int, version: int) -> Refused:
        keep = self.service.settings.keep_versions
        return refused(
            "version_gone",
            f"block {block} version {version} was pruned (the aggregator keeps the last {keep} "
            "and version 0); pull the open round",
        )


def etag_matches(header: str | None, etag: str) -> bool:
    """If-None-Match: `*`, or a list of entity tags, compared weakly (RFC 9110 13.1.2)."""
    if header is None:
        return False
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of the one range `bytes=A-B`, `bytes=A-` or `bytes=-N` asks for, clipped
    to the body; None to send the whole body (no header, or one not served here: several
    ranges, another unit, bad syntax; RFC 9110 lets a server ignore those). A range that starts
    past the end raises RangeNotSatisfiable."""
    if header is None:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # a suffix: the last N bytes
        n = int(last)
        if n == 0:
            raise RangeNotSatisfiable("an empty suffix range", size)
        return max(0, size - n), size
    start = int(first)
    end = size if not last else min(size, int(last) + 1)
    if last and int(last) < start:
        return None  # invalid: ignored
    if start >= size:
        raise RangeNotSatisfiable(f"the range starts at {start}; the body has {size} bytes", size)
    return start, end


def add_routes(
    app: FastAPI,
    service: AggregatorService,
    token: Callable[[str], Any],
    account: Callable[[Request, int], None],
    refusals: dict[int | str, dict[str, Any]],
) -> Versions:
    """GET /v1/blocks/{b}/versions/{v}, behind `token(endpoint)` (the app's authentication
    dependency) unless the weights are public; `account(request, bytes_out)` counts bytes."""
    versions = Versions(service)
    public = service.limits.public_weights
    scope = "public" if public else "private"

    def send(request: Request, body: bytes, etag: str, headers: dict[str, str]) -> Response:
        """An immutable body: 304 on a matching If-None-Match, 206 for one byte range."""
        headers = {
            "ETag": etag,
            "Cache-Control": f"{scope}, {IMMUTABLE}",
            "Accept-Ranges": "bytes",
            **headers,
        }
        if etag_matches(request.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=headers)
        size = len(body)
        span = None
        if request.headers.get("if-range") in (None, etag):  # else: it changed, send all
            span = byte_range(request.headers.get("range"), size)
        if span is None:
            account(request, size)
            return Response(body, media_type=CONTENT_TYPE, headers=headers)
        start, end = span
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        account(request, end - start)
        return Response(body[start:end], status_code=206, media_type=CONTENT_TYPE, headers=headers)

    binary = {"content": BINARY}
    cached: dict[int | str, dict[str, Any]] = {
        206: {"description": "the byte range asked for"},
        304: {"description": "not modified (If-None-Match)"},
        **refusals,
    }
    base_query = Query(
        None,
        min_length=1,
        max_length=64,
        description="the id of the view held (X-View); not needed under exact pulls",
    )
    wire_query = Query(max_length=40, description="the aggregator's pull_wire")

    def no_token() -> None:
        return None

    # a default, not in Annotated: see dashboard.add_routes
    version_auth = Depends(no_token) if public else token("weights")
    delta_auth = Depends(no_token) if public else token("delta")

    @app.get(
        "/v1/blocks/{block}/versions/{version}",
        responses={200: binary, **cached},
        summary="A committed version's weights at an immutable (cacheable) URL",
    )
    def version_weights(
        request: Request,
        block: int = Path(ge=0),
        version: int = Path(ge=0),
        _: Any = version_auth,
    ) -> Response:
        tag(request, "weights", block)
        found = versions.get(block, version)
        headers = {"X-Block": str(block), "X-Version": str(version)}
        return send(request, found.body, found.etag, headers)

    @app.get(
        DELTA_PATH,
        responses={200: binary, **cached},
        summary="A committed version as a delta from a view the worker holds (pull_wire)",
    )
    def version_delta(
        request: Request,
        block: int = Path(ge=0),
        version: int = Path(ge=0),
        base: str | None = base_query,
        wire: str = wire_query,
        _: Any = delta_auth,
    ) -> Response:
        tag(request, "delta", block)
        found = versions.delta(block, version, base, wire)
        headers = {"X-Block": str(block), "X-Version": str(version)}
        if found.view is not None:
            headers["X-View"] = found.view.id
        return send(request, found.body, found.etag, headers)

    return versions
