"""Which hosts serve which model: the models whose parts the positions of `--hosts` cover
exactly once, from every host's /v1/info. A replica that is down or disagrees is left out (and
named in `down`) while another of its position serves, and is asked again after `recheck_s`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from blocktrain.config import RunConfig
from blocktrain.errors import ConfigError
from blocktrain.serving.router.replicas import SEPARATOR, Health
from blocktrain.serving.shared.serving_errors import HostRefused, HostUnavailable, ServingError
from blocktrain.serving.shared.transport import get_json

log = logging.getLogger(__name__)


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

    def holds(self) -> tuple[object, ...]:
        """What replicas of one position must agree on."""
        held = sorted((m.name, m.kind, m.fingerprint, m.total, tuple(m.parts)) for m in self.models)
        return (self.next, tuple(held))


@dataclass(frozen=True)
class RemoteModel:
    """A model assembled from the hosts that hold its parts."""

    name: str
    kind: str  # "blocktrain" (one sweep) or "reference" (autoregressive)
    config: RunConfig
    fingerprint: str
    replicas: tuple[tuple[str, ...], ...]
    """The hops of a traversal, in order: the live replicas of each."""
    total: int  # blocks (or stages)
    parts: tuple[tuple[int, ...], ...] = ()
    """The blocks (stages) each hop holds, to name them in errors."""

    @property
    def route(self) -> list[str]:
        """The hops as `URL` or `URL|URL` (replicas)."""
        return [SEPARATOR.join(r) for r in self.replicas]

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


def assemble(
    infos: list[tuple[tuple[str, ...], _HostInfo]],
) -> tuple[dict[str, RemoteModel], dict[str, str]]:
    """Models whose parts the positions cover exactly once, and the reasons the others cannot be
    served. Positions (their live replicas, and the info they agree on) are given in chain
    order; parts are visited in increasing order."""
    holders: dict[str, dict[int, tuple[str, ...]]] = {}
    seen: dict[str, _ModelInfo] = {}
    broken: dict[str, str] = {}
    for replicas, info in infos:
        url = SEPARATOR.join(replicas)
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
                other = holders.setdefault(m.name, {}).setdefault(p, replicas)
                if other != replicas:
                    broken[m.name] = (
                        f"part {p} of {m.name!r} is on both {SEPARATOR.join(other)} and {url} "
                        f"(replicas of a block go in one --hosts position: URL{SEPARATOR}URL)"
                    )
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
        hops: list[tuple[str, ...]] = []
        parts: list[list[int]] = []
        for p in range(m.total):
            if not hops or hops[-1] != holders[name][p]:
                hops.append(holders[name][p])
                parts.append([])
            parts[-1].append(p)
        models[name] = RemoteModel(
            name, m.kind, config, m.fingerprint, tuple(hops), m.total, tuple(map(tuple, parts))
        )
    return models, broken


class Directory:
    """What the hosts serve, asked once and cached until a host fails (then asked again), or
    until `recheck_s` has passed while a replica was left out."""

    def __init__(
        self,
        positions: tuple[tuple[str, ...], ...],
        client: httpx.AsyncClient,
        health: Health,
        clock: Callable[[], float],
        recheck_s: float = 10.0,
    ) -> None:
        self.positions = positions
        self.client = client
        self.health, self.clock, self.recheck_s = health, clock, recheck_s
        self._models: dict[str, RemoteModel] | None = None
        self._asked_at = 0.0
        self.unavailable: dict[str, str] = {}
        self.down: dict[str, str] = {}
        """Replicas left out at the last asking, with the reason."""
        self._lock = asyncio.Lock()

    def invalidate(self) -> None:
        self._models = None

    async def models(self) -> dict[str, RemoteModel]:
        async with self._lock:
            if self.down and self.clock() - self._asked_at >= self.recheck_s:
                self._models = None
            if self._models is None:
                self._models, self.unavailable = assemble(await self._ask())
                self._asked_at = self.clock()
            return self._models

    async def _ask(self) -> list[tuple[tuple[str, ...], _HostInfo]]:
        urls = [u for p in self.positions for u in p]
        answers = await asyncio.gather(*(self._info(u) for u in urls), return_exceptions=True)
        by_url = dict(zip(urls, answers, strict=True))
        self.down = {}
        out: list[tuple[tuple[str, ...], _HostInfo]] = []
        for position in self.positions:
            live: list[str] = []
            agreed: _HostInfo | None = None
            for url in position:
                answer = by_url[url]
                if isinstance(answer, BaseException) and not isinstance(answer, ServingError):
                    raise answer
                if isinstance(answer, ServingError):
                    self.down[url] = answer.message
                elif agreed is not None and answer.holds() != agreed.holds():
                    self.down[url] = (
                        f"replica {url} serves other blocks or runs than {live[0]}; left out"
                    )
                else:
                    agreed = agreed or answer
                    live.append(url)
            for url in position:
                if url in self.down:
                    self.health.failed(url, self.down[url], in_flight=False)
                    log.warning("%s", self.down[url])
            if agreed is None:  # no replica of this position answered
                first = by_url[position[0]]
                assert isinstance(first, ServingError)
                raise first
            out.append((tuple(live), agreed))
        return out

    async def _info(self, url: str) -> _HostInfo:
        raw = await get_json(self.client, url, "/v1/info")
        try:
            return _HostInfo.model_validate(raw)
        except ValidationError:
            raise HostRefused(
                f"{url} is not a BlockTrain block host (bad /v1/info)", host=url
            ) from None


def unavailable_error(name: str, reason: str) -> HostUnavailable:
    return HostUnavailable(f"model {name!r} cannot be served right now: {reason}")
