"""One traversal of a model's route, whatever the message (`Traversal`, the base of
`chain.Chain`): each host's answer goes on unchanged to a replica of the next hop until one
answers the final logits or bytes; traces and time are counted (`ChainStats`). A failed replica
is retried on the next (docs/serving.md, "Batching, readiness and replicas": replicas).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import torch
from pydantic import BaseModel

from blocktrain.serving.router.directory import RemoteModel
from blocktrain.serving.router.replicas import SEPARATOR, Health
from blocktrain.serving.shared.coalesce import Coalescer
from blocktrain.serving.shared.serving_errors import (
    HostError,
    HostRefused,
    HostUnavailable,
    ServingError,
)
from blocktrain.serving.shared.transport import post_json
from blocktrain.serving.shared.wire import TraceEntry, WireError, decode, encode

log = logging.getLogger(__name__)

FINAL_KEYS = frozenset({"logits", "bytes"})
"""The tensors of a final answer; any other answer is the state for the next host."""


@dataclass
class Generation:
    """One generation's session on the hosts (`Traversal.session`)."""

    name: str
    closed: bool = False
    """Its last message told the hosts to drop its caches: nothing to release."""


@dataclass
class ChainStats:
    """What a generation cost: traversals of the chain, time inside chain calls, and the
    hosts' own compute time (from their traces)."""

    traversals: int = 0
    chain_s: float = 0.0
    host_compute_s: float = 0.0
    trace: list[TraceEntry] = field(default_factory=list)
    host_ms: dict[str, float] = field(default_factory=dict)
    """Each host's compute over all traversals, in milliseconds."""
    logits: list[torch.Tensor] | None = None
    """A list to keep the final logits of every traversal sampled on the router (logprobs);
    None keeps none."""

    def add(self, seconds: float, trace: list[TraceEntry]) -> None:
        self.traversals += 1
        self.chain_s += seconds
        self.host_compute_s += sum(t.compute_ms for t in trace) / 1000
        for t in trace:
            self.host_ms[t.host] = self.host_ms.get(t.host, 0.0) + t.compute_ms
        if not self.trace:
            self.trace = trace


class Traversal:
    """Sends one message through the hosts of a model, once (`_send`), failing over between
    the replicas of a hop (`_hop`)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        model: RemoteModel,
        *,
        stats: ChainStats | None = None,
        health: Health | None = None,
        coalescer: Coalescer | None = None,
    ) -> None:
        self.client = client
        self.coalescer = coalescer or Coalescer(client, window_s=0.0, max_sweeps=1)
        """Posts the messages: sweeps bound for one host go together when it coalesces."""
        self.model = model
        self.stats = stats if stats is not None else ChainStats()
        self.health = health if health is not None else Health(time.monotonic)
        self._pinned: dict[int, str] = {}
        """The replica each hop used last: a generation stays on it (its KV caches live there)
        until it fails."""
        self._last_url = model.route[-1]

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Generation]:
        """A generation's name on the hosts (they cache its streams under it), released on
        the way out unless its last message closed it (`Generation.closed`)."""
        generation = Generation(uuid.uuid4().hex)
        try:
            yield generation
        finally:
            if not generation.closed:  # stopped early: a stop sequence, an error, a client gone
                await self.release(generation.name)

    async def release(self, session: str) -> None:
        """Ask the hosts this generation used to drop its caches (it ended without a closing
        message), so that they do not crowd out live ones until the hosts' bounds. Best effort."""
        payload = {"model": self.model.name, "session": session}
        urls = sorted(set(self._pinned.values()))
        results = await asyncio.gather(
            *(post_json(self.client, url, "/v1/release", payload) for url in urls),
            return_exceptions=True,
        )
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                log.info("could not release session %s on %s: %s", session, url, result)

    async def _send(
        self, path: str, tensors: dict[str, torch.Tensor], header: BaseModel
    ) -> dict[str, torch.Tensor]:
        """One traversal: the message to the first hop; each host's answer goes on unchanged
        to the next hop, until a host answers the final logits or bytes."""
        t0 = time.perf_counter()
        message = encode(tensors, header.model_dump())
        trace: list[TraceEntry] = []
        for hop in range(len(self.model.replicas)):
            message, later, url = await self._hop(hop, path, message)
            trace += later
            try:
                out = decode(message)[0]
            except WireError as exc:
                raise HostRefused(
                    f"host {url} answered an unreadable message ({exc})", host=url
                ) from None
            if FINAL_KEYS & out.keys():
                self._last_url = url
                self.stats.add(time.perf_counter() - t0, trace)
                return out
        raise HostRefused(
            f"the last host of {self.model.name!r}, {url}, passed the state on instead of "
            "answering",
            host=url,
        )

    async def _hop(
        self, hop: int, path: str, message: bytes
    ) -> tuple[bytes, list[TraceEntry], str]:
        """Send `message` to a replica of `hop`: the pinned one, else the healthiest; on a
        failure of the host itself, to the next replica. -> (answer, trace, the host used)."""
        replicas = self.model.replicas[hop]
        order = self.health.order(replicas)
        pinned = self._pinned.get(hop)
        if pinned in order and not self.health.recently_failed(pinned):
            order.remove(pinned)
            order.insert(0, pinned)
        failures: list[str] = []
        for url in order:
            self.health.started(url)
            t0 = time.perf_counter()
            try:
                answer, trace = await self.coalescer.post(url, path, message)
            except ServingError as exc:
                # A refusal (4xx) would be the same on every replica: not the host's failure.
                if not isinstance(exc, HostError) or exc.status < 500:
                    self.health.succeeded(url, time.perf_counter() - t0)
                    raise
                self.health.failed(url, exc.message)
                if len(replicas) == 1:
                    raise  # no replicas: the host's own error, as before
                log.warning("replica failed, trying the next: %s", exc.message)
                failures.append(exc.message)
                continue
            self.health.succeeded(url, time.perf_counter() - t0)
            self._pinned[hop] = url
            return answer, trace, url
        what = "block" if self.model.kind == "blocktrain" else "stage"
        parts = list(self.model.parts[hop]) if self.model.parts else [hop]
        raise HostUnavailable(
            f"no replica of {what}(s) {parts} of {self.model.name!r} is left: "
            + "; ".join(failures),
            host=SEPARATOR.join(replicas),
            code="no_replica",
        )
