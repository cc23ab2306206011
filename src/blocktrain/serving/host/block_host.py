"""A block host: serves some blocks of a BlockTrain run and/or some stages of a reference run,
and passes the state on, back to the router or to its own configured --next (the app is
`host_app.py`). Who does what in one sweep: docs/serving.md, "One sweep: who does what". The
state on the wire is always "z at the next grid point"; the next hop is never read from a
request.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio.to_thread
import httpx
import torch

from blocktrain.model import Sampling
from blocktrain.model.sampler import needs_generator, sampler_for
from blocktrain.serving.host.host_settings import HostSettings
from blocktrain.serving.host.loading import HostedModel
from blocktrain.serving.host.sessions import SessionStore
from blocktrain.serving.host.sweeps import (
    CacheStats,
    SweepJob,
    SweepKey,
    SweepResult,
    final_answer,
    fresh_bucket,
    host_points,
    reusable,
    run_sweeps,
)
from blocktrain.serving.shared.batching import Batcher
from blocktrain.serving.shared.requests import byte_input, read_header, read_message, state_input
from blocktrain.serving.shared.serving_errors import BadRequest, HostRefused, reversed_stack_sweep
from blocktrain.serving.shared.transport import post_message
from blocktrain.serving.shared.wire import (
    WIRE_DTYPES,
    StageHeader,
    SweepHeader,
    TraceEntry,
    bytes_tensor,
    encode,
)

log = logging.getLogger(__name__)


class BlockHost:
    """The work behind the routes; one per app."""

    def __init__(
        self,
        settings: HostSettings,
        models: dict[str, HostedModel],
        client: httpx.AsyncClient,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.models = models
        self.client = client
        self.sessions = SessionStore(
            settings.max_sessions, settings.session_ttl_s, clock, settings.max_cache_bytes
        )
        self.cache_stats = CacheStats()
        # One computation at a time: torch already uses every core for one batch, and the
        # KV caches are only touched under this lock.
        self._compute = threading.Lock()
        self.batcher: Batcher[SweepKey, SweepJob, SweepResult] = Batcher(
            self._run_sweeps,
            window_s=settings.batch_window_ms / 1000,
            max_rows=settings.batch_rows,
        )

    # ------------------------------------------------------------------ common checks

    def info(self) -> dict[str, Any]:
        return {
            "host": self.settings.public_url,
            "next": self.settings.next_url,
            "models": [m.describe() for m in self.models.values()],
            "batching": {
                "window_ms": self.settings.batch_window_ms,
                "max_rows": self.settings.batch_rows,
                **self.batcher.stats.describe(),
            },
            "kv_cache": {
                "enabled": self.settings.kv_cache,
                "sessions": len(self.sessions),
                "bytes": self.sessions.nbytes,
                "max_bytes": self.settings.max_cache_bytes,
                **self.cache_stats.describe(),
            },
        }

    def _model(self, name: str, fingerprint: str, kind: str | None) -> HostedModel:
        """The hosted model `name` of that fingerprint (and `kind`, unless None)."""
        model = self.models.get(name)
        if model is None:
            raise HostRefused(
                f"host {self.settings.public_url} serves no model {name!r} "
                f"(it serves {', '.join(self.models)})",
                host=self.settings.public_url,
                code="unknown_model",
            )
        if kind is not None and model.kind != kind:
            raise HostRefused(
                f"model {name!r} on host {self.settings.public_url} is a "
                f"{model.kind} run, not {kind}",
                host=self.settings.public_url,
            )
        if fingerprint != model.fingerprint:
            raise HostRefused(
                f"host {self.settings.public_url} serves model {name!r} with "
                f"fingerprint {model.fingerprint}, the request expects "
                f"{fingerprint}: the hosts serve different runs or steps",
                host=self.settings.public_url,
                code="fingerprint_mismatch",
            )
        return model

    async def _pass_on(
        self, path: str, message: bytes, trace: TraceEntry
    ) -> tuple[bytes, list[TraceEntry]]:
        """The state for the next part: forwarded to this host's own --next (a chain without a
        router), else answered to the router. A host makes no request to a URL it was not
        configured with."""
        if self.settings.next_url is None:
            return message, [trace]
        answer, later = await post_message(self.client, self.settings.next_url, path, message)
        return answer, [trace, *later]

    def _generator(
        self, tensors: dict[str, torch.Tensor], header: SweepHeader | StageHeader
    ) -> tuple[torch.Generator | None, Sampling | None]:
        """The request's generator, when this chain draws from it (the last host samples the
        bytes, or the sampler's steps draw noise), and how the bytes are drawn."""
        sampler = header.sampler if isinstance(header, SweepHeader) else None
        steps_draw = sampler is not None and needs_generator(sampler)
        if header.final != "bytes" and not steps_draw:
            return None, None
        state = tensors.get("generator")
        if state is None or state.dtype != torch.uint8 or state.dim() != 1:
            why = "final = bytes" if header.final == "bytes" else f"the {sampler} sampler"
            raise BadRequest(
                f"{why} needs the generator state as a uint8 tensor 'generator'",
                param="generator",
            )
        gen = torch.Generator()
        try:
            gen.set_state(state.clone())
        except RuntimeError as exc:
            raise BadRequest(
                f"'generator' is not a CPU generator state ({exc})", param="generator"
            ) from None
        spec = header.sampling
        if spec is not None and spec.utf8 and header.final == "bytes":
            raise BadRequest(
                "utf8 sampling draws the final bytes where the context is (the router): "
                "ask for final = logits",
                param="sampling",
            )
        sampling = (
            Sampling()
            if spec is None
            else Sampling(spec.temperature, spec.top_k, spec.top_p, utf8=spec.utf8)
        )
        return gen, sampling

    def _trace(self, model: HostedModel, parts: list[int], seconds: float) -> TraceEntry:
        return TraceEntry(
            host=self.settings.public_url, model=model.name, parts=parts, compute_ms=seconds * 1000
        )

    # ------------------------------------------------------------------ one sweep

    async def sweep(self, body: bytes) -> tuple[bytes, list[TraceEntry]]:
        tensors, raw = read_message(body)
        header = read_header(SweepHeader, raw)
        model = self._model(header.model, header.fingerprint, "blocktrain")
        cfg = model.config.model
        if cfg.intervals == "reversed":
            raise reversed_stack_sweep(model.name)
        try:
            sampler_for(header.sampler)
        except ValueError as exc:
            raise BadRequest(str(exc), param="sampler") from None
        x = byte_input(tensors, "x")  # (N, Lx)
        n, lx = x.shape
        if not 1 <= n <= self.settings.max_batch:
            raise BadRequest(
                f"batch of {n} sequences; at most {self.settings.max_batch}", param="x"
            )
        drafted = header.drafted
        if header.verifies and (cfg.span != 1 or header.final != "logits"):
            raise BadRequest(
                "a verify sweep (drafted > 0 or draws > 1) needs a K = 1 model and final = logits",
                param="drafted" if drafted else "draws",
            )
        # The z tokens take positions lx - drafted .. lx + K - 1 - drafted, all below T.
        if not 1 + drafted <= lx <= cfg.seq_len - cfg.span:
            raise BadRequest(
                f"context of {lx} bytes with {drafted} drafted; this model takes "
                f"{1 + drafted}..{cfg.seq_len - cfg.span} (T - K)",
                param="x",
            )
        grid = model.grid(header.steps_per_block)
        if header.step >= len(grid):
            raise BadRequest(
                f"step {header.step} is past the grid's {len(grid)} points", param="step"
            )
        if header.fork and (
            header.sampler != "ancestral" or header.draws < 2 or header.fork >= len(grid)
        ):
            raise BadRequest(
                f"draws fork at a grid point 1..{len(grid) - 1} of an ancestral verify sweep "
                f"of 2 or more draws, not at {header.fork} ({header.sampler}, {header.draws} "
                "draws)",
                param="fork",
            )
        z_len = cfg.span
        if header.verifies:  # the copies of the draws exist from the fork on
            z_len = (header.draws if header.step >= header.fork else 1) * (drafted + 1)
        z = state_input(tensors, "z", (n, z_len, cfg.d_model), header.wire_dtype)
        first_block = grid[header.step][0]
        if first_block not in model.parts:
            raise HostRefused(
                f"host {self.settings.public_url} holds blocks {model.parts} of "
                f"{model.name!r}, but the sweep is at block {first_block}",
                host=self.settings.public_url,
                code="misrouted",
            )
        upstream = None
        if cfg.reads_upstream and first_block > 0:  # block b - 1's clean output
            upstream = state_input(tensors, "u", (n, lx, cfg.d_model), header.wire_dtype)
        gen, sampling = self._generator(tensors, header)
        session = header.session if self.settings.kv_cache else None
        # To the blocks' device (the generator stays on the CPU: draws move to the state).
        x, z = x.to(model.device), z.to(model.device)
        upstream = None if upstream is None else upstream.to(model.device)
        job = SweepJob(model, header, x, z, grid, gen, sampling, session, upstream)
        # Sweeps at the same point with the same state shape share one forward pass
        # (shared/batching.py), bucketed by the clean positions they compute (their caches may be
        # dropped before they run: that costs time, never the result).
        points = host_points(grid, header.step, model.parts)
        blocks = sorted({grid[i][0] for i in points})
        fresh = lx - reusable([job], blocks, self.sessions)[0][0]
        key = (
            model.name,
            header.step,
            header.steps_per_block,
            header.sampler,
            drafted,
            header.draws,
            header.fork,
            z_len,
            fresh_bucket(fresh),
        )
        result = await self.batcher.submit(key, n, job)
        trace = self._trace(model, result.blocks, result.seconds)
        if result.final is not None:
            return result.final, [trace]
        forward = header.model_copy(update={"step": result.step})
        wire = WIRE_DTYPES[header.wire_dtype]
        out = {"x": bytes_tensor(x), "z": result.z.to(wire)}
        if result.upstream is not None:
            out["u"] = result.upstream.to(wire)
        if gen is not None:
            out["generator"] = gen.get_state()
        return await self._pass_on("/v1/sweep", encode(out, forward.model_dump()), trace)

    def _run_sweeps(self, key: SweepKey, jobs: list[SweepJob]) -> list[SweepResult]:
        return run_sweeps(jobs, self._compute, self.sessions, self.cache_stats)

    # ------------------------------------------------------------------ autoregressive stages

    async def stage(self, body: bytes) -> tuple[bytes, list[TraceEntry]]:
        tensors, raw = read_message(body)
        header = read_header(StageHeader, raw)
        model = self._model(header.model, header.fingerprint, None)
        cfg = model.config.model
        blocktrain = model.kind == "blocktrain"
        if blocktrain and not model.head_stages:
            raise BadRequest(
                f"{model.name!r} answers stage steps through its head exit, which reads the "
                "chain of clean streams: a route = features run",
                param="exit",
            )
        if header.stage not in model.parts:
            raise HostRefused(
                f"host {self.settings.public_url} holds stages {model.parts} of "
                f"{model.name!r}, but the step is at stage {header.stage}",
                host=self.settings.public_url,
                code="misrouted",
            )
        x = byte_input(tensors, "x") if blocktrain or header.stage == 0 else None  # (N, L)
        if header.stage == 0:
            assert x is not None
            inp = x
        else:
            if "h" not in tensors or tensors["h"].dim() != 3:
                raise BadRequest("stage > 0 needs hidden states 'h' (N, L, d)", param="h")
            n_, l_ = tensors["h"].shape[:2]
            inp = state_input(tensors, "h", (n_, l_, cfg.d_model), header.wire_dtype)
            if x is not None and tuple(x.shape) != (n_, l_):
                raise BadRequest(f"'x' {tuple(x.shape)} must be (N, L) of 'h'", param="x")
        n, length = inp.shape[:2]
        if not 1 <= n <= self.settings.max_batch:
            raise BadRequest(
                f"batch of {n} sequences; at most {self.settings.max_batch}", param="x"
            )
        if length < 1 or header.pos + length > cfg.seq_len:
            raise BadRequest(
                f"positions {header.pos}..{header.pos + length - 1} do not fit the "
                f"model's context of {cfg.seq_len}",
                param="pos",
            )
        if header.verify and (header.verify >= length or header.final != "logits"):
            raise BadRequest(
                f"verify = {header.verify} needs more than that many tokens and final = logits",
                param="verify",
            )
        gen, sampling = self._generator(tensors, header)
        x = None if x is None else x.to(model.device)
        inp = inp.to(model.device)
        run = functools.partial(self._run_stages, model, header, x, inp, gen, sampling)
        h, stage, done, visited, seconds = await anyio.to_thread.run_sync(run)
        trace = self._trace(model, visited, seconds)
        if done is not None:
            return done, [trace]
        forward = header.model_copy(update={"stage": stage})
        out = {"h": h.to(WIRE_DTYPES[header.wire_dtype])}
        if blocktrain:  # each block's clean stream reads the bytes beside the one before it
            assert x is not None
            out["x"] = bytes_tensor(x)
        if gen is not None:
            out["generator"] = gen.get_state()
        return await self._pass_on("/v1/stage", encode(out, forward.model_dump()), trace)

    @torch.no_grad()
    def _run_stages(
        self,
        model: HostedModel,
        header: StageHeader,
        x: torch.Tensor | None,
        inp: torch.Tensor,
        gen: torch.Generator | None,
        sampling: Sampling | None,
    ) -> tuple[torch.Tensor, int, bytes | None, list[int], float]:
        """The stages held here from header.stage on: a reference's, or a BlockTrain run's
        head stages (its blocks' clean streams, reading the bytes x beside the stage before)."""
        stage = header.stage
        visited: list[int] = []
        h = inp
        with self._compute:
            t0 = time.perf_counter()
            while stage in model.stages or stage in model.head_stages:
                cache = self.sessions.open(model.name, header.session, stage, header.pos)
                if model.kind == "blocktrain":
                    assert x is not None
                    h = model.head_stages[stage](x, None if stage == 0 else h, cache)
                else:
                    h = model.stages[stage](h, cache)
                visited.append(stage)
                stage += 1
            if header.close:
                self.sessions.close(model.name, header.session, visited)
            final = None
            if stage == model.total:  # logits (N, 256), or (N, D + 1, 256) to verify a draft
                out = h[:, -(header.verify + 1) :] if header.verify else h[:, -1]
                final = final_answer(out, header.final, gen, sampling)
            return h, stage, final, visited, time.perf_counter() - t0
