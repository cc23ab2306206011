"""The router: takes generation requests (`/v1/generate`, the OpenAI routes, `/v1/models`,
`/healthz`, `/readyz`) and sends each span's state along the chain of hosts (docs/serving.md;
its "Errors" has the statuses). It learns what the hosts serve from their /v1/info and asks
again after any host failure, so it keeps serving once a host is back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

import httpx
import torch

from blocktrain.model import Sampling, SigmaSchedule
from blocktrain.model.heads import resolve_exit
from blocktrain.model.sampler import DEFAULT_SAMPLER, sampler_for
from blocktrain.model.speculative import SpeculativeLoop, verify_fork
from blocktrain.serving.router.chain import Chain
from blocktrain.serving.router.directory import Directory, RemoteModel, unavailable_error
from blocktrain.serving.router.generate_schemas import Prompt, SamplingParams
from blocktrain.serving.router.limits import WorkLimiter, work_units
from blocktrain.serving.router.replicas import Health
from blocktrain.serving.router.router_settings import RouterSettings
from blocktrain.serving.router.streams import (
    autoregressive_speculative_stream,
    autoregressive_stream,
    one_sweep_stream,
    speculative_stream,
)
from blocktrain.serving.router.traversal import ChainStats
from blocktrain.serving.shared.coalesce import Coalescer
from blocktrain.serving.shared.serving_errors import (
    BadRequest,
    HostError,
    HostRefused,
    ServingError,
    reversed_stack_sweep,
)
from blocktrain.serving.shared.wire import WireDtype

YIELD_POLL_S = 0.01
"""How often a job that yields to a newcomer (`WorkLimiter.should_yield`) looks again."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One validated generation request."""

    model: RemoteModel
    prompt: bytes
    n_bytes: int
    sampling: Sampling
    seed: int
    steps_per_block: int
    sampler: str
    draft_bytes: int
    verify_draws: int
    units: int
    """The work admitted for this job, released by `Router.done`."""
    client: str = ""
    """Whose work it is (its token, or its address: `limits.holder_of`), for its share of the
    work in flight."""
    address: str | None = None
    """The client's address, when the client is a token: it holds to a share too."""
    exit: str = "sampler"
    """A one-sweep model's exit, resolved (never `auto`): the sampler, or its head (one byte
    per traversal)."""

    @property
    def autoregressive(self) -> bool:
        """One byte per traversal through stages: a reference, or a stack's head exit."""
        return self.model.kind == "reference" or self.exit == "head"


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.client = client
        self.health = Health(clock)
        self.directory = Directory(settings.positions, client, self.health, clock)
        self.work = WorkLimiter(
            settings.max_work, settings.max_work_in_flight, per_client=settings.work_per_client
        )
        self.coalescer = Coalescer(
            client,
            window_s=settings.coalesce_window_ms / 1000,
            max_sweeps=settings.coalesce_sweeps,
        )

    def chain(self, model: RemoteModel, stats: ChainStats | None = None) -> Chain:
        return Chain(
            self.client,
            model,
            wire_dtype=cast(WireDtype, self.settings.wire_dtype),
            sample_on=self.settings.sample_on,
            stats=stats,
            health=self.health,
            coalescer=self.coalescer,
        )

    async def resolve(self, name: str | None) -> RemoteModel:
        models = await self.directory.models()
        if name is None:
            if len(models) == 1:
                return next(iter(models.values()))
            raise BadRequest(
                f"name a model: this router serves {model_names(models)}", param="model"
            )
        if name in models:
            return models[name]
        if name in self.directory.unavailable:
            raise unavailable_error(name, self.directory.unavailable[name])
        raise BadRequest(
            f"model {name!r} is not served here; served: {model_names(models)}",
            param="model",
            code="model_not_found",
            status=404,
        )

    async def job(
        self,
        *,
        model: str | None,
        prompt: Prompt,
        n_bytes: int,
        param: str,
        req: SamplingParams,
        choices: int = 1,
        logprobs: bool = False,
        client: str = "",
        address: str | None = None,
    ) -> Job:
        """A validated job, its work admitted: `choices` samples of n_bytes each (with their
        logprobs: then it drafts only when the request asks)."""
        data = prompt_bytes(prompt, self.settings.max_prompt_bytes)
        if n_bytes > self.settings.max_output_bytes:
            raise BadRequest(
                f"{param} = {n_bytes} exceeds this router's limit of "
                f"{self.settings.max_output_bytes} bytes",
                param=param,
            )
        if req.steps_per_block > self.settings.max_steps_per_block:
            raise BadRequest(
                f"steps_per_block = {req.steps_per_block} exceeds this router's "
                f"limit of {self.settings.max_steps_per_block}",
                param="steps_per_block",
            )
        sampling = Sampling(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, utf8=req.utf8
        )
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        remote = await self.resolve(model)
        sampler = req.sampler
        if remote.kind == "blocktrain":
            try:
                sampler = sampler_for(req.sampler)
            except ValueError as exc:
                raise BadRequest(str(exc), param="sampler") from None
        exit_ = resolve_exit(req.exit, remote.config.model if remote.kind == "blocktrain" else None)
        self._check_exit(remote, exit_)
        head = exit_ == "head"
        draft = req.draft_bytes
        if draft is None:
            draft = 0 if logprobs else self._default_draft(remote)
        elif draft:
            self._check_drafting(remote, draft)
        # An autoregressive model runs no sampler points: one unit per byte. A verify sweep of
        # M draws computes M sweeps' z tokens on every host.
        blocktrain = remote.kind == "blocktrain" and not head
        steps = req.steps_per_block if blocktrain else 1
        draws = req.verify_draws if blocktrain and draft else 1
        names = ["n"] * (choices > 1) + [param, "steps_per_block"] + ["verify_draws"] * (draws > 1)
        values = [choices] * (choices > 1) + [n_bytes, steps] + [draws] * (draws > 1)
        what = f"{' x '.join(names)} = {' x '.join(map(str, values))}"
        units = self.work.admit(
            choices * work_units(n_bytes, steps * draws), what, param, client, address
        )
        return Job(
            remote,
            data,
            n_bytes,
            sampling,
            seed,
            req.steps_per_block,
            sampler or DEFAULT_SAMPLER,
            draft,
            req.verify_draws,
            units,
            client,
            address,
            exit=exit_,
        )

    @staticmethod
    def _check_exit(model: RemoteModel, exit_: str) -> None:
        """The head exit reads a features stack's chain; a reversed stack has no other."""
        cfg = model.config.model
        if exit_ == "head" and (model.kind != "blocktrain" or cfg.route != "features"):
            raise BadRequest(
                "exit = head reads the chain of clean streams of a route = features BlockTrain "
                f"run; {model.name!r} is not one",
                param="exit",
            )
        if exit_ == "sampler" and model.kind == "blocktrain" and cfg.intervals == "reversed":
            raise reversed_stack_sweep(model.name)

    def done(self, job: Job, parked: bool = False) -> None:
        """The job ended (answered, failed or abandoned): its work is no longer in flight, nor
        in its client's share."""
        self.work.release(job.units, job.client, parked, job.address)

    def park(self, job: Job) -> None:
        """The job's stream waits for a client that reads nothing: its work leaves the work in
        flight (a waiting stream computes nothing) until `resume`, but not its client's share."""
        self.work.park(job.units)

    def resume(self, job: Job) -> bool:
        """Count a parked job's work in flight again -> whether it fits now."""
        return self.work.unpark(job.units)

    def _draft_limit(self, model: RemoteModel) -> int:
        """The most bytes a traversal may verify: the window keeps room for the context."""
        return min(self.settings.max_draft_bytes, model.config.model.seq_len - 2)

    @staticmethod
    def _spans(model: RemoteModel) -> bool:
        """A one-sweep model with K > 1: its span is drawn at once, there is nothing to verify."""
        return model.kind == "blocktrain" and model.config.model.span != 1

    def _default_draft(self, model: RemoteModel) -> int:
        """The router's draft_bytes for a request that leaves it out: 0 where drafting does not
        apply (no default, or a K > 1 model), else the default within the model's limit."""
        if not self.settings.draft_bytes or self._spans(model):
            return 0
        return min(self.settings.draft_bytes, self._draft_limit(model))

    def _check_drafting(self, model: RemoteModel, draft_bytes: int) -> None:
        why = None
        if self.settings.drafter is None:
            why = (
                "this router has no drafter (start `blocktrain serve` with --draft-corpus or "
                "--draft-model)"
            )
        elif self._spans(model):
            why = (
                "speculative drafting verifies with a K = 1 one-sweep model or an "
                f"autoregressive one; {model.name!r} has K = {model.config.model.span}"
            )
        elif draft_bytes > self._draft_limit(model):
            why = f"draft_bytes = {draft_bytes} exceeds the limit of {self._draft_limit(model)}"
        if why is not None:
            raise BadRequest(why, param="draft_bytes")

    async def stream(self, job: Job, stats: ChainStats) -> AsyncIterator[torch.Tensor]:
        """The new bytes (1, m) piece by piece. Before each next piece, a job whose client holds
        more than its fair share of a budget over its limit waits (`WorkLimiter.should_yield`)."""
        pieces = self._pieces(job, stats)
        try:
            async for piece in pieces:
                yield piece
                while self.work.should_yield(job.client):
                    await asyncio.sleep(YIELD_POLL_S)
        finally:  # stopped early or cancelled: the loop ends now (a host's cache expires)
            if isinstance(pieces, AsyncGenerator):
                await pieces.aclose()

    def _pieces(self, job: Job, stats: ChainStats) -> AsyncIterator[torch.Tensor]:
        chain = self.chain(job.model, stats)
        prompt = torch.tensor([list(job.prompt)], dtype=torch.long)
        gen = torch.Generator().manual_seed(job.seed)
        if job.draft_bytes:
            assert self.settings.drafter is not None  # checked when the job was made
            draws = 1 if job.autoregressive else job.verify_draws
            points = 0  # of the one-sweep model's grid, where its draws may fork
            if not job.autoregressive:
                schedule = SigmaSchedule.from_config(job.model.config.model)
                points = len(schedule.sampler_grid(job.steps_per_block))
            loop = SpeculativeLoop(
                prompt,
                job.n_bytes,
                drafter=self.settings.drafter,
                draft_len=job.draft_bytes,
                seq_len=job.model.config.model.seq_len,
                sampling=job.sampling,
                generator=gen,
                # An autoregressive verifier is deterministic: more draws would repeat one.
                draws=draws,
                fork=verify_fork(points, job.sampler, draws),
            )
            if job.autoregressive:
                return autoregressive_speculative_stream(chain, loop)
            return speculative_stream(
                chain, loop, steps_per_block=job.steps_per_block, sampler=job.sampler
            )
        if not job.autoregressive:
            return one_sweep_stream(
                chain,
                prompt,
                job.n_bytes,
                sampling=job.sampling,
                generator=gen,
                steps_per_block=job.steps_per_block,
                sampler=job.sampler,
            )
        return autoregressive_stream(
            chain, prompt, job.n_bytes, sampling=job.sampling, generator=gen
        )

    def failed(self, exc: ServingError) -> ServingError:
        """A host failed: ask the hosts again next time; a refusal is the chain's fault, not
        the client's (502)."""
        if isinstance(exc, HostError):
            self.directory.invalidate()
        if isinstance(exc, HostRefused):
            return HostRefused(
                f"the chain refused the request: {exc.message}",
                host=exc.host,
                code=exc.code,
                status=502,
            )
        return exc


def model_names(models: dict[str, RemoteModel]) -> str:
    return ", ".join(sorted(models)) or "(none)"


def prompt_bytes(prompt: Prompt, limit: int) -> bytes:
    if isinstance(prompt, str):
        data = prompt.encode("utf-8")
    else:
        if any(not 0 <= v <= 255 for v in prompt):
            raise BadRequest("a prompt given as a list holds byte values 0..255", param="prompt")
        data = bytes(prompt)
    if not data:
        raise BadRequest("prompt must hold at least one byte", param="prompt", code="empty_prompt")
    if len(data) > limit:
        raise BadRequest(
            f"prompt of {len(data)} bytes exceeds this router's limit of {limit}",
            param="prompt",
            code="prompt_too_long",
        )
    return data
