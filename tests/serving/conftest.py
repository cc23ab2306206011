"""Fixtures for the serving tests: micro runs trained once per session, and chains of block
hosts running in this process (httpx ASGI transports, no sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.data import load_split
from blocktrain.model import BlockStack, Sampling, SigmaSchedule, generate, stack_denoiser
from blocktrain.serving import (
    HostSettings,
    ModelSource,
    RouterSettings,
    create_host_app,
    create_router_app,
)
from blocktrain.training import Trainer, load_model
from tests.conftest import TEXT, micro_config


@dataclass(frozen=True)
class Runs:
    blocktrain: Path  # span K = 2, T = 16, 3 blocks of 1 layer (the default route, features)
    reference: Path
    next_byte: Path  # the same with span K = 1 (speculative drafting verifies with it)
    features: (
        Path  # the K = 2 run, `route = features` set explicitly (block b + 1 reads b's stream)
    )
    features_next_byte: Path  # and its K = 1 twin
    state: Path  # the K = 2 run under `route = state` (only z passes between blocks)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("serving-runs")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "wiki.train.raw").write_text(TEXT * 40)
    train = load_split(corpus, "train")
    cfg = micro_config(steps=2)
    for kind in ("blocktrain", "reference"):
        Trainer.create(cfg, root / kind, train, None, kind=kind).run(progress=False)
    k1 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, span=1))
    Trainer.create(k1, root / "k1", train, None, kind="blocktrain").run(progress=False)
    for name, base, route in (
        ("features", cfg, "features"),
        ("features-k1", k1, "features"),
        ("state", cfg, "state"),
    ):
        routed = dataclasses.replace(base, model=dataclasses.replace(base.model, route=route))
        Trainer.create(routed, root / name, train, None, kind="blocktrain").run(progress=False)
    return Runs(
        root / "blocktrain",
        root / "reference",
        root / "k1",
        root / "features",
        root / "features-k1",
        root / "state",
    )


class Apps(httpx.AsyncBaseTransport):
    """Routes each request to the in-process app serving its base URL. A URL in `down` refuses
    connections; one in `dies` takes the request and drops the connection without answering
    (a host that died mid-request); `before(url, request)` runs ahead of each request."""

    def __init__(self) -> None:
        self.apps: dict[str, object] = {}
        self.down: set[str] = set()
        self.dies: set[str] = set()
        self.before: Callable[[str, httpx.Request], None] | None = None
        self.calls: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.calls.append(f"{base}{request.url.path}")
        if self.before is not None:
            self.before(base, request)
        if base in self.down or base not in self.apps:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        response = await httpx.ASGITransport(app=self.apps[base]).handle_async_request(request)
        if base in self.dies:
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response.", request=request
            )
        return response


URLS = ["http://host0:8101", "http://host1:8102", "http://host2:8103"]


@dataclass
class Cluster:
    apps: Apps
    urls: list[str]
    runs: Runs

    def router(self, **settings: object) -> contextlib.AbstractContextManager[TestClient]:
        hosts = settings.pop("hosts", tuple(self.urls))
        app = create_router_app(
            RouterSettings(hosts=hosts, **settings),  # type: ignore[arg-type]
            transport=self.apps,
        )
        return TestClient(app)


def start_cluster(
    runs: Runs,
    parts: list[tuple[int, ...]] | None = None,
    next_urls: bool = False,
    models: tuple[ModelSource, ...] | None = None,
    **host_settings: object,
) -> Cluster:
    """Hosts holding `parts` (default: block i on host i) of `models` (default: "bt", "ref"
    and "bt1", the K = 2, reference and K = 1 runs)."""
    apps = Apps()
    parts = parts or [(0,), (1,), (2,)]
    urls = URLS[: len(parts)]
    models = models or (
        ModelSource("bt", runs.blocktrain),
        ModelSource("ref", runs.reference),
        ModelSource("bt1", runs.next_byte),
    )
    for i, (url, held) in enumerate(zip(urls, parts, strict=True)):
        settings = HostSettings(
            models=models,
            parts=held,
            public_url=url,
            next_url=urls[i + 1] if next_urls and i + 1 < len(urls) else None,
            **host_settings,  # type: ignore[arg-type]
        )
        apps.apps[url] = create_host_app(settings, transport=apps)
    return Cluster(apps, urls, runs)


@pytest.fixture
def cluster(runs: Runs) -> Cluster:
    """Three hosts, block (and reference stage) i on host i, all in this process."""
    return start_cluster(runs)


@pytest.fixture(scope="session")
def stack(runs: Runs) -> BlockStack:
    _, model = load_model(runs.blocktrain)
    assert isinstance(model, BlockStack)
    return model


def in_process(
    stack: BlockStack,
    prompt: bytes,
    n: int,
    seed: int,
    sampling: Sampling | None = None,
    steps_per_block: int = 1,
    sampler: str = "euler",
) -> list[int]:
    """What `blocktrain generate` produces for the same request."""
    cfg = stack.cfg
    out = generate(
        stack_denoiser(stack),
        torch.tensor([list(prompt)]),
        n,
        grid=SigmaSchedule.from_config(cfg).sampler_grid(steps_per_block),
        targets=stack.targets,
        span=cfg.span,
        max_context=cfg.seq_len - cfg.span,
        sampling=sampling or Sampling(),
        generator=torch.Generator().manual_seed(seed),
        method=sampler,
    )
    return out[0].tolist()


@pytest.fixture
def router(cluster: Cluster) -> Iterator[TestClient]:
    with cluster.router() as client:
        yield client


def generate_together(
    cluster: Cluster, bodies: list[dict[str, Any]], **settings: Any
) -> tuple[list[httpx.Response], Any]:
    """POST every body to a router over `cluster` at once (asyncio.gather through an ASGI
    transport); the responses in order, and the router."""
    app = create_router_app(
        RouterSettings(hosts=tuple(cluster.urls), **settings), transport=cluster.apps
    )

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await asyncio.gather(
                *(client.post("/v1/generate", json=body, timeout=60) for body in bodies)
            )

    return asyncio.run(main()), app.state.router
