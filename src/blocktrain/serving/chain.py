"""The router's side of the chain: which hosts serve which model (`Directory`), and one
traversal of them (`Chain`): a sweep of one span's state, a verify sweep of a draft, or one
autoregressive step. The generation loops over a chain are in `streams.py`.

Per sweep the router draws the initial noise from the request's generator, sends z = sigma_max *
noise along the chain once (to each host of the route in turn: a host answers the state for the
next one, and the next hop is the router's choice, never a URL in a message), and samples the span's bytes from the final logits with the same
generator (or lets the last host sample with the generator's state, which comes back advanced;
so does the state when the sampler's steps draw noise on the hosts). With the state in fp32 on
the wire, the bytes are those of `generate` (same shapes, same code path).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from pydantic import BaseModel, ValidationError

from blocktrain.config import RunConfig
from blocktrain.errors import ConfigError
from blocktrain.model import Sampling, sample_bytes
from blocktrain.model.sampler import needs_generator
from blocktrain.serving.errors import HostRefused, HostUnavailable
from blocktrain.serving.transport import get_json, post_message
from blocktrain.serving.wire import (
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


class _ModelInfo(BaseModel):
    name: str
    kind: str
    parts: list[int]
    total: int
    fingerprint: str
    config: dict[str, Any]


class _HostInfo(BaseModel):
    host: str
    next: str | None = None
    models: list[_ModelInfo]


@dataclass(frozen=True)
class RemoteModel:
    """A model assembled from the hosts that hold its parts."""

    name: str
    kind: str  # "blocktrain" (one sweep) or "reference" (autoregressive)
    config: RunConfig
    fingerprint: str
    route: list[str]  # host URLs in the order a traversal visits them
    total: int  # blocks (or stages)

    def describe(self) -> dict[str, Any]:
        m = self.config.model
        return {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": "blocktrain",
            "kind": self.kind,
            "hosts": self.route,
            "span": m.span if self.kind == "blocktrain" else 1,
            "context": m.seq_len,
            "blocks": self.total,
            "d_model": m.d_model,
            "fingerprint": self.fingerprint,
        }


def assemble(infos: list[tuple[str, _HostInfo]]) -> tuple[dict[str, RemoteModel], dict[str, str]]:
    """Models whose parts the hosts cover exactly once, and the reasons the others cannot be
    served. Hosts are given in chain order; parts are visited in increasing order."""
    holders: dict[str, dict[int, str]] = {}
    seen: dict[str, _ModelInfo] = {}
    broken: dict[str, str] = {}
    for url, info in infos:
        for m in info.models:
            first = seen.setdefault(m.name, m)
            if info.next is not None:
                broken[m.name] = (
                    f"host {url} forwards to its own --next {info.next}; the hosts behind a "
                    "router take no --next (the router sends the state from host to host)"
                )
            if (m.fingerprint, m.kind, m.total) != (first.fingerprint, first.kind, first.total):
                broken[m.name] = (
                    f"hosts disagree on model {m.name!r}: {url} serves "
                    f"fingerprint {m.fingerprint}, another {first.fingerprint}"
                )
            for p in m.parts:
                other = holders.setdefault(m.name, {}).setdefault(p, url)
                if other != url:
                    broken[m.name] = f"part {p} of {m.name!r} is on both {other} and {url}"
    models: dict[str, RemoteModel] = {}
    for name, m in seen.items():
        if name in broken:
            continue
        missing = [p for p in range(m.total) if p not in holders.get(name, {})]
        what = "block" if m.kind == "blocktrain" else "stage"
        if missing:
            broken[name] = f"no host holds {what}(s) {missing} of {name!r}"
            continue
        try:
            config = RunConfig.from_dict(m.config)
        except ConfigError as exc:
            broken[name] = f"model {name!r}: {exc}"
            continue
        route: list[str] = []
        for p in range(m.total):
            if not route or route[-1] != holders[name][p]:
                route.append(holders[name][p])
        models[name] = RemoteModel(name, m.kind, config, m.fingerprint, route, m.total)
    return models, broken


class Directory:
    """What the hosts serve, asked once and cached until a host fails (then asked again)."""

    def __init__(self, hosts: list[str], client: httpx.AsyncClient) -> None:
        self.hosts = hosts
        self.client = client
        self._models: dict[str, RemoteModel] | None = None
        self.unavailable: dict[str, str] = {}
        self._lock = asyncio.Lock()

    def invalidate(self) -> None:
        self._models = None

    async def models(self) -> dict[str, RemoteModel]:
        async with self._lock:
            if self._models is None:
                infos = await asyncio.gather(*(self._info(url) for url in self.hosts))
                self._models, self.unavailable = assemble(list(zip(self.hosts, infos, strict=True)))
            return self._models

    async def _info(self, url: str) -> _HostInfo:
        raw = await get_json(self.client, url, "/v1/info")
        try:
            return _HostInfo.model_validate(raw)
        except ValidationError:
            raise HostRefused(
                f"{url} is not a BlockTrain block host (bad /v1/info)", host=url
            ) from None


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
    ) -> None:
        self.client = client
        self.model = model
        self.wire_dtype = wire_dtype
        self.final: Final = "bytes" if sample_on == "last-host" else "logits"
        self.stats = stats if stats is not None else ChainStats()

    def _spec(self, sampling: Sampling) -> SamplingSpec:
        return SamplingSpec(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p
        )

    async def _send(
        self, path: str, tensors: dict[str, torch.Tensor], header: BaseModel
    ) -> dict[str, torch.Tensor]:
        """One traversal: the message goes to the first host of the route; each host answers
        the state for the next one, which goes on unchanged to the next host of the route,
        until a host answers the final logits or bytes."""
        t0 = time.perf_counter()
        message = encode(tensors, header.model_dump())
        trace: list[TraceEntry] = []
        for url in self.model.route:
            message, later = await post_message(self.client, url, path, message)
            trace += later
            try:
                out = decode(message)[0]
            except WireError as exc:
                raise HostRefused(
                    f"host {url} answered an unreadable message ({exc})", host=url
                ) from None
            if FINAL_KEYS & out.keys():
                self.stats.add(time.perf_counter() - t0, trace)
                return out
        raise HostRefused(
            f"the last host of {self.model.name!r}, {self.model.route[-1]}, passed the state "
            "on instead of answering",
            host=self.model.route[-1],
        )

    def _finish(
        self, out: dict[str, torch.Tensor], sampling: Sampling, generator: torch.Generator
    ) -> torch.Tensor:
        """The sampled bytes, drawn here or by the last host. Whenever the chain drew from the
        request's generator, its advanced state comes back and is adopted here."""
        if "generator" in out:
            generator.set_state(out["generator"])
        if self.final == "logits":
            if "logits" not in out:
                raise HostRefused("the last host answered no logits", host=self.model.route[-1])
            if self.stats.logits is not None:
                self.stats.logits.append(out["logits"].cpu())
            return sample_bytes(out["logits"].cpu(), sampling, generator)
        if "bytes" not in out or "generator" not in out:
            raise HostRefused("the last host answered no bytes", host=self.model.route[-1])
        return out["bytes"].long()

    async def _sweep(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        *,
        final: Final,
        drafted: int,
        steps_per_block: int,
        sampler: str,
        sampling: Sampling,
        generator: torch.Generator,
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
    ) -> torch.Tensor:
        """x (N, Lx) int64 context, z (N, K, d) fp32 at sigma_max -> the span's bytes (N, K)."""
        out = await self._sweep(
            x,
            z,
            final=self.final,
            drafted=0,
            steps_per_block=steps_per_block,
            sampler=sampler,
            sampling=sampling,
            generator=generator,
        )
        return self._finish(out, sampling, generator)

    async def verify(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        *,
        drafted: int,
        steps_per_block: int,
        sampler: str,
        sampling: Sampling,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """One verify sweep (model.speculative): x (1, P + D) the context then the draft, z
        (1, D + 1, d) -> the final logits (1, D + 1, 256); the router applies the rule."""
        out = await self._sweep(
            x,
            z,
            final="logits",
            drafted=drafted,
            steps_per_block=steps_per_block,
            sampler=sampler,
            sampling=sampling,
            generator=generator,
        )
        if "generator" in out:
            generator.set_state(out["generator"])
        if "logits" not in out:
            raise HostRefused("the last host answered no logits", host=self.model.route[-1])
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
    ) -> torch.Tensor:
        """tokens (N, L) int64 at positions pos.. -> the next byte (N,)."""
        header = StageHeader(
            model=self.model.name,
            fingerprint=self.model.fingerprint,
            final=self.final,
            sampling=self._spec(sampling),
            wire_dtype=self.wire_dtype,
            stage=0,
            session=session,
            pos=pos,
            close=close,
        )
        tensors = {"x": bytes_tensor(tokens)}
        if self.final == "bytes":
            tensors["generator"] = generator.get_state()
        return self._finish(await self._send("/v1/stage", tensors, header), sampling, generator)

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
            raise HostRefused("the last host answered no logits", host=self.model.route[-1])
        logits = out["logits"]
        return logits if drafted else logits[:, None]


def unavailable_error(name: str, reason: str) -> HostUnavailable:
    return HostUnavailable(f"model {name!r} cannot be served right now: {reason}")
