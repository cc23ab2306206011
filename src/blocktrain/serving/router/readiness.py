"""The router's readiness check, `GET /readyz` (docs/serving.md, "Batching, readiness and
replicas"): a 1-byte sweep or step through every replica of every hop of every served model, so
that each host shows it can compute, not merely answer."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import torch

from blocktrain.model.heads import resolve_exit
from blocktrain.serving.router.chain_router import Router
from blocktrain.serving.router.directory import RemoteModel, unavailable_error
from blocktrain.serving.router.traversal import FINAL_KEYS
from blocktrain.serving.shared.serving_errors import HostRefused, HostUnavailable, ServingError
from blocktrain.serving.shared.transport import post_message
from blocktrain.serving.shared.wire import StageHeader, SweepHeader, WireError, decode, encode

PROBE_BYTE = 10
"""The context of the probe (a newline)."""


def _probe_message(model: RemoteModel) -> tuple[str, bytes]:
    x = torch.tensor([[PROBE_BYTE]], dtype=torch.uint8)
    cfg = model.config.model
    if model.kind == "blocktrain" and resolve_exit("auto", cfg) == "sampler":
        header: SweepHeader | StageHeader = SweepHeader(
            model=model.name, fingerprint=model.fingerprint, step=0, steps_per_block=1
        )
        tensors = {"x": x, "z": torch.zeros(1, cfg.span, cfg.d_model)}
        return "/v1/sweep", encode(tensors, header.model_dump())
    header = StageHeader(
        model=model.name,
        fingerprint=model.fingerprint,
        stage=0,
        session=f"readyz-{uuid.uuid4().hex}",
        pos=0,
        close=True,  # the probe leaves no KV cache behind
    )
    return "/v1/stage", encode({"x": x}, header.model_dump())


async def _probe(router: Router, model: RemoteModel) -> tuple[dict[str, str], ServingError | None]:
    """-> (per host: "ok" or why it failed, the error that stopped the sweep or None)."""
    path, message = _probe_message(model)
    results: dict[str, str] = {}
    for hop, replicas in enumerate(model.replicas):
        answer: bytes | None = None
        for url in replicas:
            router.health.started(url)
            t0 = time.perf_counter()
            try:
                out, _ = await post_message(router.client, url, path, message)
                decode(out)
            except (ServingError, WireError) as exc:
                why = exc.message if isinstance(exc, ServingError) else f"{url}: {exc}"
                router.health.failed(url, why)
                results[url] = why
                continue
            router.health.succeeded(url, time.perf_counter() - t0)
            results[url] = "ok"
            answer = answer or out
        if answer is None:
            parts = list(model.parts[hop]) if model.parts else [hop]
            failed = "; ".join(results[u] for u in replicas)
            return results, HostUnavailable(
                f"the readiness sweep of {model.name!r} failed at block(s) {parts}: {failed}",
                host="|".join(replicas),
                code="not_ready",
            )
        message = answer
        if FINAL_KEYS & decode(message)[0].keys():
            return results, None
    last = "|".join(model.replicas[-1])
    return results, HostRefused(f"the last host of {model.name!r} ({last}) answered no logits")


class Readiness:
    """Runs the probe; concurrent /readyz calls wait for one probe rather than stack up sweeps."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._lock = asyncio.Lock()

    async def check(self) -> tuple[bool, dict[str, Any]]:
        async with self._lock:
            return await self._check()

    async def _check(self) -> tuple[bool, dict[str, Any]]:
        directory = self.router.directory
        directory.invalidate()  # ask every host again: one that came back counts
        body: dict[str, Any] = {"ready": False, "models": {}}
        error: ServingError | None = None
        try:
            models = await directory.models()
        except ServingError as exc:
            models, error = {}, exc
        for name, model in sorted(models.items()):
            body["models"][name], failed = await _probe(self.router, model)
            error = error or failed
        for name, reason in sorted(directory.unavailable.items()):
            error = error or unavailable_error(name, reason)
        if error is None and not models:
            error = HostUnavailable("the hosts serve no complete model")
        body["down"] = dict(directory.down)
        body["hosts"] = {
            url: self.router.health.describe(url)
            for position in directory.positions
            for url in position
        }
        if error is not None:
            body["error"] = self.router.failed(error).to_json()["error"]
            return False, body
        body["ready"] = True
        return True, body
