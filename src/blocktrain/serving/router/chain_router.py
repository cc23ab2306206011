"""The router: takes generation requests and sends each span's state along the chain of hosts.

    POST /v1/generate      BlockTrain's own API (bytes, seed, traversals, timing)
    POST /v1/completions   OpenAI-compatible completions, non-streaming and streaming (SSE)
    POST /v1/chat/completions   the same for chat, over a byte-level template (chat.py)
    GET  /v1/models        the models the hosts assemble into complete chains
    GET  /healthz          liveness of the router itself
    GET  /readyz           readiness: a 1-byte sweep through every host (readiness.py)

A BlockTrain model is served by one sweep per span of K bytes; a reference model by the
autoregressive pipeline, one traversal per byte. The router learns what the hosts serve from
their /v1/info and asks again after any host failure, so it keeps serving once a host is back;
a position of the chain may hold replicas, and a failed hop is retried on another (replicas.py).

Errors are OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code", "host"}}`: 400 for
a bad request (404 for an unknown model, 413 for a body over the limit, 422 for more work than
one request may ask for, 429 over the rate or in-flight work limit), 503 naming the host that is unreachable or died
mid-request, 504 for one that timed out, 502 for a host that refused the state. In a stream
that has already started, a failure arrives as a last `data: {"error": ...}` event.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import cast

import httpx
import torch

from blocktrain.errors import ConfigError
from blocktrain.model import Sampling, SigmaSchedule
from blocktrain.model.sampler import DEFAULT_SAMPLER, sampler_for
from blocktrain.model.speculative import Drafter, SpeculativeLoop, verify_fork
from blocktrain.serving.router.chain import Chain, ChainStats
from blocktrain.serving.router.directory import Directory, RemoteModel, unavailable_error
from blocktrain.serving.router.generate_schemas import Prompt, SamplingParams
from blocktrain.serving.router.limits import WorkLimiter, work_units
from blocktrain.serving.router.replicas import Health, parse_positions
from blocktrain.serving.router.streams import (
    autoregressive_speculative_stream,
    autoregressive_stream,
    one_sweep_stream,
    speculative_stream,
)
from blocktrain.serving.shared.coalesce import Coalescer
from blocktrain.serving.shared.serving_errors import (
    BadRequest,
    HostError,
    HostRefused,
    ServingError,
)
from blocktrain.serving.shared.wire import WireDtype

log = logging.getLogger(__name__)


def check_url(url: str, what: str = "host URL") -> str:
    """An http(s)://HOST:PORT URL, without a trailing slash; anything else is a ConfigError."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"{what} {url!r} is not an http(s)://HOST:PORT URL")
    return url.rstrip("/")


def _positions(hosts: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return parse_positions(hosts, lambda url: check_url(url, "--hosts entry"))


@dataclass(frozen=True)
class RouterSettings:
    """How the router runs."""

    hosts: tuple[str, ...]
    """Block hosts, in chain order (the first receives each request); an entry may name
    replicas of one position as `URL|URL` (replicas.py)."""
    hop_ms: float = 0.0
    """Emulated one-way latency of the link to the first host (see transport.py)."""
    timeout_s: float = 300.0
    """Read timeout of one traversal of the chain."""
    wire_dtype: str = "fp32"
    """dtype of the state on the wire: fp32 (exact) or fp16 (half the bytes)."""
    sample_on: str = "router"
    """Where the final bytes are drawn: 'router' (the last host returns logits) or
    'last-host' (it returns bytes; the generator state travels with the state)."""
    max_prompt_bytes: int = 65536
    """Longest prompt accepted."""
    max_output_bytes: int = 4096
    """Most bytes generated per request."""
    max_steps_per_block: int = 16
    """Largest steps_per_block a request may ask for."""
    drafter: Drafter | None = None
    """Drafts bytes for speculative generation with K = 1 models (requests' draft_bytes): a
    byte n-gram (data.ngram) or a small autoregressive model (model.speculative.ModelDrafter)."""
    max_draft_bytes: int = 32
    """Largest draft_bytes a request may ask for."""
    draft_bytes: int = 0
    """draft_bytes of the requests that leave it out, where drafting applies: a K = 1 or
    autoregressive model, and no logprobs asked (0: requests opt in)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (a prompt of 65536 byte values as a JSON list fits)."""
    rate_per_minute: int = 600
    """Generation requests a minute per client address (0: no limit): a flood of cheap
    requests; the work limits below bound the compute."""
    max_work: int = 4096
    """Most work in one request, in bytes x steps_per_block (limits.work_units)."""
    max_work_in_flight: int = 16384
    """Most work of all requests in flight together."""
    max_work_per_client: int | None = None
    """Most work of one client address's requests in flight together; None: half of
    max_work_in_flight (and at least max_work), so one client cannot hold the whole budget."""
    send_timeout_s: float = 30.0
    """A stream whose client reads none of it for this long (one send blocked) is ended, and
    its work released (openai_api._Stream)."""
    secret: str | None = field(default=None, repr=False)
    """The hosts' shared secret, sent with every request to them (auth.py)."""
    ca_cert: str | None = None
    """PEM bundle to verify https hosts against (None: the system's CAs)."""
    coalesce_sweeps: int = 64
    """Most sweeps of concurrent generations sent to one host in one request (coalesce.py);
    1: each its own request. At most the hosts' --max-batch (default 64 too)."""
    coalesce_window_ms: float = 0.0
    """How long a sweep waits for others bound for the same host (0: none; those that arrive
    while a request to the host is in flight go together after it)."""

    @property
    def work_per_client(self) -> int:
        """Work one client address may have in flight at once."""
        if self.max_work_per_client is not None:
            return self.max_work_per_client
        return max(self.max_work, self.max_work_in_flight // 2)

    @property
    def positions(self) -> tuple[tuple[str, ...], ...]:
        """The replicas of each position of the chain."""
        return _positions(self.hosts)

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigError("--hosts must name at least one block host")
        _positions(self.hosts)  # checks every URL, and that none appears twice
        if self.hop_ms < 0:
            raise ConfigError(f"--hop-ms {self.hop_ms} must be >= 0")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout {self.timeout_s} must be positive")
        if self.wire_dtype not in ("fp32", "fp16"):
            raise ConfigError(f"--wire {self.wire_dtype!r} must be fp32 or fp16")
        if self.sample_on not in ("router", "last-host"):
            raise ConfigError(f"--sample-on {self.sample_on!r} must be router or last-host")
        for name in (
            "max_prompt_bytes",
            "max_output_bytes",
            "max_steps_per_block",
            "max_draft_bytes",
            "max_body_bytes",
            "max_work",
            "max_work_in_flight",
            "coalesce_sweeps",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} = {getattr(self, name)} must be positive")
        if not 0 <= self.draft_bytes <= self.max_draft_bytes:
            raise ConfigError(
                f"--draft-bytes {self.draft_bytes} must lie in 0..{self.max_draft_bytes}"
            )
        if self.draft_bytes and self.drafter is None:
            raise ConfigError("--draft-bytes needs a drafter: --draft-corpus or --draft-model")
        if self.coalesce_window_ms < 0:
            raise ConfigError(f"--coalesce-window-ms {self.coalesce_window_ms} must be >= 0")
        if self.rate_per_minute < 0:
            raise ConfigError(f"--rate-limit {self.rate_per_minute} must be >= 0 (0: none)")
        if self.send_timeout_s <= 0:
            raise ConfigError(f"--send-timeout {self.send_timeout_s} must be positive")
        if self.max_work_per_client is not None and not (
            self.max_work <= self.max_work_per_client <= self.max_work_in_flight
        ):
            raise ConfigError(
                f"--max-work-per-client {self.max_work_per_client} must lie in --max-work "
                f"{self.max_work} .. --max-work-in-flight {self.max_work_in_flight}"
            )
        if self.max_work > self.max_work_in_flight:
            raise ConfigError(
                f"--max-work {self.max_work} exceeds --max-work-in-flight "
                f"{self.max_work_in_flight}: no request could ever run"
            )


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
    """Whose work it is (the client's address), for its share of the work in flight."""


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
                sampler = sampler_for(req.sampler, remote.config.model.process)
            except ValueError as exc:
                raise BadRequest(str(exc), param="sampler") from None
        draft = req.draft_bytes
        if draft is None:
            draft = 0 if logprobs else self._default_draft(remote)
        elif draft:
            self._check_drafting(remote, draft)
        # An autoregressive model runs no sampler points: one unit per byte. A verify sweep of
        # M draws computes M sweeps' z tokens on every host.
        blocktrain = remote.kind == "blocktrain"
        steps = req.steps_per_block if blocktrain else 1
        draws = req.verify_draws if blocktrain and draft else 1
        names = ["n"] * (choices > 1) + [param, "steps_per_block"] + ["verify_draws"] * (draws > 1)
        values = [choices] * (choices > 1) + [n_bytes, steps] + [draws] * (draws > 1)
        what = f"{' x '.join(names)} = {' x '.join(map(str, values))}"
        units = self.work.admit(choices * work_units(n_bytes, steps * draws), what, param, client)
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
        )

    def done(self, job: Job) -> None:
        """The job ended (answered, failed or abandoned): its work is no longer in flight."""
        self.work.release(job.units, job.client)

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

    def stream(self, job: Job, stats: ChainStats) -> AsyncIterator[torch.Tensor]:
        """The new bytes (1, m) piece by piece: a span per sweep, or a byte per traversal."""
        chain = self.chain(job.model, stats)
        prompt = torch.tensor([list(job.prompt)], dtype=torch.long)
        gen = torch.Generator().manual_seed(job.seed)
        if job.draft_bytes:
            assert self.settings.drafter is not None  # checked when the job was made
            draws = 1 if job.model.kind == "reference" else job.verify_draws
            points = 0  # of the one-sweep model's grid, where its draws may fork
            if job.model.kind == "blocktrain":
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
            if job.model.kind == "reference":
                return autoregressive_speculative_stream(chain, loop)
            return speculative_stream(
                chain, loop, steps_per_block=job.steps_per_block, sampler=job.sampler
            )
        if job.model.kind == "blocktrain":
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
