"""The router's side of the chain: the messages of one traversal of a model's hosts (`Chain`): a
sweep of one span's state, a verify sweep of a draft, or one autoregressive step. Who does what
in a sweep: docs/serving.md, "One sweep: who does what"; the route itself is `traversal.py`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
import torch

from blocktrain.model import Sampling, sample_bytes
from blocktrain.model.sampler import needs_generator
from blocktrain.serving.router.directory import RemoteModel
from blocktrain.serving.router.replicas import Health
from blocktrain.serving.router.traversal import ChainStats, Traversal
from blocktrain.serving.shared.coalesce import Coalescer
from blocktrain.serving.shared.serving_errors import HostRefused
from blocktrain.serving.shared.wire import (
    WIRE_DTYPES,
    Final,
    SamplingSpec,
    StageHeader,
    SweepHeader,
    WireDtype,
    bytes_tensor,
)

H = TypeVar("H", SweepHeader, StageHeader)


class Chain(Traversal):
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
        super().__init__(client, model, stats=stats, health=health, coalescer=coalescer)
        self.wire_dtype = wire_dtype
        self.final: Final = "bytes" if sample_on == "last-host" else "logits"

    def _header(self, kind: type[H], final: Final, sampling: Sampling | None, **fields: Any) -> H:
        """The header of one message: the model and its run, what the last host answers, the
        sampling it draws with (None: nothing) and the wire dtype, then the message's `fields`."""
        spec = None
        if sampling is not None:
            spec = SamplingSpec(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                utf8=sampling.utf8,
            )
        return kind(
            model=self.model.name,
            fingerprint=self.model.fingerprint,
            final=final,
            sampling=spec,
            wire_dtype=self.wire_dtype,
            **fields,
        )

    def _logits(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        if "logits" not in out:
            raise HostRefused("the last host answered no logits", host=self._last_url)
        return out["logits"]

    def _final(self, sampling: Sampling) -> Final:
        """Where a traversal's bytes are drawn: a request that keeps to UTF-8 is drawn here,
        whatever sample_on says: the last host of an autoregressive chain holds only the
        newest bytes, not the context the constraint follows."""
        return "logits" if sampling.utf8 else self.final

    def _finish(
        self,
        out: dict[str, torch.Tensor],
        sampling: Sampling,
        generator: torch.Generator,
        context: torch.Tensor,
    ) -> torch.Tensor:
        """The sampled bytes, drawn here (after `context` (N, L)) or by the last host; the
        generator's advanced state, whenever it comes back, is adopted here."""
        if "generator" in out:
            generator.set_state(out["generator"])
        if self._final(sampling) == "logits":
            logits = self._logits(out).cpu()
            if self.stats.logits is not None:
                self.stats.logits.append(logits)
            return sample_bytes(logits, sampling, generator, prefix=context)
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
        header = self._header(
            SweepHeader,
            final,
            sampling,
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
        The hosts cache `session`'s clean streams until a sweep with `close`."""
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
        (1, M (D + 1), d) ((1, D + 1, d) with a `fork`) -> the final logits (1, M (D + 1), 256).
        The hosts cut the session's caches back to the bytes the next sweep keeps."""
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
        return self._logits(out)

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
        """tokens (N, L) int64 at positions pos.. -> the next byte (N,), drawn after `context`
        (default: the tokens)."""
        final = self._final(sampling)
        header = self._header(StageHeader, final, sampling, session=session, pos=pos, close=close)
        tensors = {"x": bytes_tensor(tokens)}
        if final == "bytes":
            tensors["generator"] = generator.get_state()
        out = await self._send("/v1/stage", tensors, header)
        return self._finish(out, sampling, generator, tokens if context is None else context)

    async def stage_verify(
        self, tokens: torch.Tensor, *, session: str, pos: int, close: bool, drafted: int
    ) -> torch.Tensor:
        """tokens (1, L) at positions pos.., the last `drafted` a draft -> the logits of the
        last drafted + 1 positions (1, drafted + 1, 256)."""
        header = self._header(
            StageHeader, "logits", None, session=session, pos=pos, close=close, verify=drafted
        )
        out = await self._send("/v1/stage", {"x": bytes_tensor(tokens)}, header)
        logits = self._logits(out)
        return logits if drafted else logits[:, None]
