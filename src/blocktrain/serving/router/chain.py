"""The router's side of the chain: one traversal of the hosts of a model (`Chain`): a sweep of
one span's state, a verify sweep of a draft, or one autoregressive step. Which hosts serve which
model is `directory.py`; the generation loops over a chain are in `streams.py`.

Per sweep the router draws the initial noise from the request's generator, sends z = sigma_max *
noise along the chain once (to each host of the route in turn: a host answers the state for the
next one, and the next hop is the router's choice, never a URL in a message), and samples the span's bytes from the final logits with the same
generator (or lets the last host sample with the generator's state, which comes back advanced;
so does the state when the sampler's steps draw noise on the hosts). With the state in fp32 on
the wire, the bytes are those of `generate` (same shapes, same code path).

A hop with several replicas (replicas.py) sends to the healthiest, and sends the same message to
the next one when a replica fails (connection error, timeout, 5xx): the traversal goes on, and
fails (503, naming the blocks) only when no replica of a hop is left.
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

from blocktrain.model import Sampling, sample_bytes
from blocktrain.model.sampler import needs_generator
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
from blocktrain.serving.shared.wire import (
    WIRE_DTYPES,
    Final,
    SamplingSpec,
    StageHeader,
    SweepHeader,
    TraceEntry,
    WireDtype,
    WireError,
    bytes_tensor,
    decode,
    encode,
)

log = logging.getLogger(__name__)

FINAL_KEYS = frozenset({"logits", "bytes"})
"""The tensors of a final answer; any other answer is the state for the next host."""


@dataclass
class Generation:
    """One generation's session on the hosts (`Chain.session`)."""

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


class Chain:
    """Sends one span's state (or one step's tokens) through the hosts of a model, once."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        model: RemoteModel,
        *,
        wire_dtype: WireDtype = "fp32",
        sample_on: str = "router",
        stats: ChainStats | None = None,
        health: Health | None = None,
        coalescer: Coalescer | None = None,
    ) -> None:
        self.client = client
        self.coalescer = coalescer or Coalescer(client, window_s=0.0, max_sweeps=1)
        """Posts the messages: sweeps bound for one host go together when it coalesces."""
        self.model = model
        self.wire_dtype = wire_dtype
        self.final: Final = "bytes" if sample_on == "last-host" else "logits"
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
        """Ask the hosts this generation used to drop its caches: for a generation that ended
        without a closing message (a stop sequence, a speculative one, a client that left),
        so that its caches do not wait for the hosts' bounds and crowd out live ones. Best
        effort: a host that cannot be reached drops them at its bounds all the same."""
        payload = {"model": self.model.name, "session": session}
        urls = sorted(set(self._pinned.values()))
        results = await asyncio.gather(
            *(post_json(self.client, url, "/v1/release", payload) for url in urls),
            return_exceptions=True,
        )
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                log.info("could not release session %s on %s: %s", session, url, result)

    def _spec(self, sampling: Sampling) -> SamplingSpec:
        return SamplingSpec(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            utf8=sampling.utf8,
        )

    def _final(self, sampling: Sampling) -> Final:
        """Where a traversal's bytes are drawn: a request that keeps to UTF-8 is drawn here,
        whatever --sample-on says, since the last host of an autoregressive chain holds only
        the newest bytes, not the context the constraint follows."""
        return "logits" if sampling.utf8 else self.final

    async def _send(
        self, path: str, tensors: dict[str, torch.Tensor], header: BaseModel
    ) -> dict[str, torch.Tensor]:
        """One traversal: the message goes to the first hop of the route; each host answers
        the state for the next one, which goes on unchanged to the next hop of the route,
        until a host answers the final logits or bytes."""
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

    def _finish(
        self,
        out: dict[str, torch.Tensor],
        sampling: Sampling,
        generator: torch.Generator,
        context: torch.Tensor,
    ) -> torch.Tensor:
        """The sampled bytes, drawn here (after `context` (N, L), the bytes before them) or by
        the last host. Whenever the chain drew from the request's generator, its advanced
        state comes back and is adopted here."""
        if "generator" in out:
            generator.set_state(out["generator"])
        if self._final(sampling) == "logits":
            if "logits" not in out:
                raise HostRefused("the last host answered no logits", host=self._last_url)
            if self.stats.logits is not None:
                self.stats.logits.append(out["logits"].cpu())
            return sample_bytes(out["logits"].cpu(), sampling, generator, prefix=context)
        if "bytes" not in out or "generator" not in out:
            raise HostRefused("the last host answered no bytes", host=self._last_url)
        return out["bytes"].long()

    async def _sweep(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        *,
        final: Final,
        drafted: int,
        draws: int = 1,
        fork: int = 0,
        steps_per_block: int,
        sampler: str,
        sampling: Sampling,
        generator: torch.Generator,
        session: str | None,
        close: bool,
    ) -> dict[str, torch.Tensor]:
        header = SweepHeader(
            model=self.model.name,
            fingerprint=self.model.fingerprint,
            final=final,
            sampling=self._spec(sampling),
            wire_dtype=self.wire_dtype,
            step=0,
            steps_per_block=steps_per_block,
            sampler=sampler,
            drafted=drafted,
            draws=draws,
            fork=fork,
            session=session,
            close=close,
        )
        tensors = {"x": bytes_tensor(x), "z": z.to(WIRE_DTYPES[self.wire_dtype])}
        if final == "bytes" or needs_generator(sampler):
            tensors["generator"] = generator.get_state()
        return await self._send("/v1/sweep", tensors, header)

    async def sweep(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        *,
        steps_per_block: int,
        sampler: str,
        sampling: Sampling,
        generator: torch.Generator,
        session: str | None = None,
        close: bool = False,
    ) -> torch.Tensor:
        """x (N, Lx) int64 context, z (N, K, d) fp32 at sigma_max -> the span's bytes (N, K).
        `session` names the generation, whose clean streams the hosts cache until a sweep
        with `close` (the last)."""
        out = await self._sweep(
            x,
            z,
            final=self._final(sampling),
            drafted=0,
            steps_per_block=steps_per_block,
            sampler=sampler,
            sampling=sampling,
            generator=generator,
            session=session,
            close=close,
        )
        return self._finish(out, sampling, generator, context=x)

    async def verify(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        *,
        drafted: int,
        draws: int = 1,
        fork: int = 0,
        steps_per_block: int,
        sampler: str,
        sampling: Sampling,
        generator: torch.Generator,
        session: str | None = None,
        close: bool = False,
    ) -> torch.Tensor:
        """One verify sweep (model.speculative): x (1, P + D) the context then the draft, z
        (1, M (D + 1), d), M = draws ((1, D + 1, d) when the draws `fork` later) -> the final
        logits (1, M (D + 1), 256); the router applies the rule. The hosts cut the session's
        caches back to the bytes the next sweep keeps."""
        out = await self._sweep(
            x,
            z,
            final="logits",
            drafted=drafted,
            draws=draws,
            fork=fork,
            steps_per_block=steps_per_block,
            sampler=sampler,
            sampling=sampling,
            generator=generator,
            session=session,
            close=close,
        )
        if "generator" in out:
            generator.set_state(out["generator"])
        if "logits" not in out:
            raise HostRefused("the last host answered no logits", host=self._last_url)
        return out["logits"]

    async def stage_step(
        self,
        tokens: torch.Tensor,
        *,
        session: str,
        pos: int,
        close: bool,
        sampling: Sampling,
        generator: torch.Generator,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (N, L) int64 at positions pos.. -> the next byte (N,), drawn after
        `context` (N, L'), the generation's bytes so far (default: the tokens)."""
        final = self._final(sampling)
        header = StageHeader(
            model=self.model.name,
            fingerprint=self.model.fingerprint,
            final=final,
            sampling=self._spec(sampling),
            wire_dtype=self.wire_dtype,
            stage=0,
            session=session,
            pos=pos,
            close=close,
        )
        tensors = {"x": bytes_tensor(tokens)}
        if final == "bytes":
            tensors["generator"] = generator.get_state()
        out = await self._send("/v1/stage", tensors, header)
        return self._finish(out, sampling, generator, tokens if context is None else context)

    async def stage_verify(
        self, tokens: torch.Tensor, *, session: str, pos: int, close: bool, drafted: int
    ) -> torch.Tensor:
        """tokens (1, L) at positions pos.., the last `drafted` a draft -> the logits of the
        last drafted + 1 positions (1, drafted + 1, 256); the router applies the rule."""
        header = StageHeader(
            model=self.model.name,
            fingerprint=self.model.fingerprint,
            final="logits",
            wire_dtype=self.wire_dtype,
            stage=0,
            session=session,
            pos=pos,
            close=close,
            verify=drafted,
        )
        out = await self._send("/v1/stage", {"x": bytes_tensor(tokens)}, header)
        if "logits" not in out:
            raise HostRefused("the last host answered no logits", host=self._last_url)
        logits = out["logits"]
        return logits if drafted else logits[:, None]
