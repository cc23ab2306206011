"""Coalescing: the router sends the sweeps of several generations bound for one host as one
`POST /v1/sweeps`, and the host answers them in one response (docs/serving.md, "Batching,
readiness and replicas" and "The wire"). Most of what a hop costs is per request (HTTP, the
event loop, the hand-off to the compute thread), not the forward pass the host's batcher already
merges. Each sweep keeps its own header and runs through the single-sweep code, so a
generation's bytes are those of /v1/sweep.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import torch

from blocktrain.serving.shared.batching import Batcher
from blocktrain.serving.shared.requests import read_message
from blocktrain.serving.shared.serving_errors import (
    BadRequest,
    HostRefused,
    ServingError,
    error_from_json,
)
from blocktrain.serving.shared.transport import post_message
from blocktrain.serving.shared.wire import TraceEntry, WireError, decode, encode

SWEEP_PATH = "/v1/sweep"
SWEEPS_PATH = "/v1/sweeps"

Answer = tuple[bytes, list[TraceEntry]]
Outcome = Answer | ServingError


def _as_tensor(message: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(message), dtype=torch.uint8)


def pack(messages: list[bytes]) -> bytes:
    """Several /v1/sweep bodies -> one /v1/sweeps body."""
    return encode({str(i): _as_tensor(m) for i, m in enumerate(messages)}, {"count": len(messages)})


def unpack(body: bytes, max_sweeps: int) -> list[bytes]:
    """A /v1/sweeps body -> its sweep bodies; a 400 for a malformed envelope or too many."""
    tensors, header = read_message(body)
    count = header.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= max_sweeps:
        raise BadRequest(
            f"a multi-sweep message holds 1..{max_sweeps} sweeps; its count is {count!r}",
            param="count",
        )
    names = [str(i) for i in range(count)]
    if sorted(tensors) != sorted(names):
        raise BadRequest(
            f"a multi-sweep message of {count} sweeps must hold tensors 0..{count - 1}",
            param="count",
        )
    for name in names:
        if tensors[name].dtype != torch.uint8 or tensors[name].dim() != 1:
            raise BadRequest(f"sweep {name} must be a (B,) uint8 message", param=name)
    return [tensors[name].numpy().tobytes() for name in names]


def pack_answers(outcomes: list[Outcome]) -> bytes:
    """Each sweep's answer or error -> one /v1/sweeps answer."""
    tensors: dict[str, torch.Tensor] = {}
    results: list[dict[str, Any]] = []
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, ServingError):
            results.append({"status": outcome.status, **outcome.to_json()})
        else:
            tensors[str(i)] = _as_tensor(outcome[0])
            results.append({"trace": [t.model_dump() for t in outcome[1]]})
    return encode(tensors, {"results": results})


def unpack_answers(body: bytes, count: int, url: str) -> list[Outcome]:
    """A host's /v1/sweeps answer -> each sweep's answer, or the error the host gave it."""
    try:
        tensors, header = decode(body)
    except WireError as exc:
        raise HostRefused(f"host {url} answered an unreadable message ({exc})", host=url) from None
    results = header.get("results")
    if not isinstance(results, list) or len(results) != count:
        raise HostRefused(f"host {url} answered the wrong number of sweeps", host=url)
    outcomes: list[Outcome] = []
    for i, result in enumerate(results):
        answer = tensors.get(str(i))
        if not isinstance(result, dict):
            raise HostRefused(f"host {url} answered a malformed result {i}", host=url)
        if answer is None:
            status = result.get("status")
            code = status if isinstance(status, int) and 400 <= status <= 599 else 502
            outcomes.append(error_from_json(code, result, default_host=url))
            continue
        try:
            trace = [TraceEntry.model_validate(t) for t in result.get("trace", [])]
        except (TypeError, ValueError):
            trace = []
        outcomes.append((answer.numpy().tobytes(), trace))
    return outcomes


async def host_sweeps(
    sweep: Callable[[bytes], Awaitable[Answer]], body: bytes, max_sweeps: int
) -> bytes:
    """The host's /v1/sweeps: every sweep through `sweep` at once (the batcher merges them),
    each one's answer or refusal in the one response. An error that is not a refusal (a bug)
    fails the whole request, as it would a single sweep."""
    messages = unpack(body, max_sweeps)
    done = await asyncio.gather(*(sweep(m) for m in messages), return_exceptions=True)
    outcomes: list[Outcome] = []
    for outcome in done:
        if isinstance(outcome, BaseException) and not isinstance(outcome, ServingError):
            raise outcome
        outcomes.append(outcome)
    return pack_answers(outcomes)


class Coalescer:
    """The router's side: posts a message to a host, gathering concurrent sweeps to the same
    host into one /v1/sweeps request when `max_sweeps` > 1."""

    def __init__(self, client: httpx.AsyncClient, *, window_s: float, max_sweeps: int) -> None:
        if window_s < 0 or max_sweeps < 1:
            raise ValueError(f"window {window_s} s must be >= 0 and max sweeps {max_sweeps} >= 1")
        self.client, self.window_s, self.max_sweeps = client, window_s, max_sweeps
        self._batchers: dict[str, Batcher[str, bytes, Outcome]] = {}

    async def post(self, url: str, path: str, message: bytes) -> Answer:
        """As transport.post_message: the answer and its trace, or the host's error."""
        if path != SWEEP_PATH or self.max_sweeps == 1:
            return await post_message(self.client, url, path, message)
        batcher = self._batchers.get(url)
        if batcher is None:  # one per host: a batch in flight to one host holds up no other
            batcher = Batcher(self._post, window_s=self.window_s, max_rows=self.max_sweeps)
            self._batchers[url] = batcher
        outcome = await batcher.submit(url, 1, message)
        if isinstance(outcome, ServingError):
            raise outcome
        return outcome

    async def _post(self, url: str, messages: list[bytes]) -> list[Outcome]:
        if len(messages) == 1:
            return [await post_message(self.client, url, SWEEP_PATH, messages[0])]
        body, _ = await post_message(self.client, url, SWEEPS_PATH, pack(messages))
        return unpack_answers(body, len(messages), url)

    def describe(self) -> dict[str, Any]:
        """Requests and sweeps per host, for /v1/info-like reports and the load bench."""
        return {url: b.stats.describe() for url, b in self._batchers.items()}
