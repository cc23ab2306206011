"""The router's request and response models: its own `/v1/generate` and the OpenAI-compatible
`/v1/completions` (`/v1/chat/completions` is in chat.py). Requests are strict (unknown fields are
refused with a reason); tokens are bytes, so `max_tokens` counts bytes and a prompt may be a
string or a list of byte values."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blocktrain.model.sampler import DEFAULT_STEPS_PER_BLOCK, check_sampler
from blocktrain.model.speculative import DEFAULT_VERIFY_DRAWS, MAX_VERIFY_DRAWS

Prompt = str | list[int]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=256)
    """Keep the k likeliest bytes (0: all); an extension of the OpenAI schema."""
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Seeds the initial noise and the sampling; the same seed gives the same bytes."""
    steps_per_block: int = Field(DEFAULT_STEPS_PER_BLOCK, ge=1)
    """Sampler grid points per block (one-sweep models); an extension."""
    sampler: str | None = None
    """The sampler's step between grid points, one of model.sampler.SAMPLERS (one-sweep
    models; default: the model's, DEFAULT_SAMPLER for Gaussian models, "reveal" for masked
    ones); an extension."""

    draft_bytes: int | None = Field(None, ge=0)
    """Speculative generation with a K = 1 model (an extension): bytes drafted on the router
    and verified per traversal; the text keeps the model's own law. 0: off; left out: the
    router's default (`serve --draft-bytes`), where drafting applies."""
    verify_draws: int = Field(DEFAULT_VERIFY_DRAWS, ge=1, le=MAX_VERIFY_DRAWS)
    """Noise draws of each verify sweep of a one-sweep model, whose mean law the
    rule takes (model.speculative): more bytes accepted per traversal, at compute, not hops;
    an extension. An autoregressive verifier is deterministic and takes one."""

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, value: str | None) -> str | None:
        return None if value is None else check_sampler(value)


class GenerateRequest(SamplingParams):
    model: str | None = None
    """Which served model; may be left out when the router serves exactly one."""
    prompt: Prompt
    max_bytes: int = Field(64, ge=1)


class Timing(BaseModel):
    total_s: float
    """Wall time of the whole request inside the router."""
    chain_s: float
    """Time inside calls to the chain (transport, emulated latency and compute)."""
    host_compute_s: float
    """The hosts' own compute time, as their traces report it."""


class GenerateResponse(BaseModel):
    model: str
    kind: str
    text: str
    """The bytes decoded as UTF-8 (invalid sequences replaced)."""
    bytes: list[int]
    seed: int
    prompt_bytes: int
    output_bytes: int
    traversals: int
    """Traversals of the chain: ceil(n / K) for one sweep, n for the autoregressive pipeline."""
    hosts: list[str]
    """The chain, in the order a traversal visits it."""
    timing: Timing


MAX_STOPS = 4
MAX_STOP_BYTES = 1024
"""Bytes (UTF-8) of one stop sequence: what a choice holds back, and what its scan carries."""
MAX_TOP_LOGPROBS = 20


class OpenAIParams(SamplingParams):
    """The parameters /v1/completions and /v1/chat/completions share (openai_api.py)."""

    model: str
    stream: bool = False
    n: int = Field(1, ge=1, le=16)
    """Choices, each its own sample (seeds seed, seed + 1, ...)."""
    stop: str | list[str] | None = None
    """Up to 4 sequences of at most 1 KiB each; the text ends before the first one generated."""
    user: str | None = Field(None, max_length=256)
    """Who asks: recorded in the router's log."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        longest = max((len(s.encode("utf-8", "surrogatepass")) for s in stops), default=0)
        if longest > MAX_STOP_BYTES:
            raise ValueError(
                f"a stop sequence may hold at most {MAX_STOP_BYTES} bytes (UTF-8), got {longest}"
            )
        return value

    def stops(self) -> list[str]:
        """The stop sequences, as a list."""
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    def refused(self) -> dict[str, bool]:
        """Parameters that would change the output in ways this model cannot honour: refused
        rather than ignored."""
        return {
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }

    @model_validator(mode="after")
    def _supported(self) -> OpenAIParams:
        bad = [name for name, yes in self.refused().items() if yes]
        if bad:
            raise ValueError(f"{bad[0]}: not supported by this server (leave it at its default)")
        return self


class CompletionRequest(OpenAIParams):
    """POST /v1/completions, as the OpenAI API defines it."""

    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    """Bytes to generate."""
    echo: bool = False
    """Return the prompt before the completion."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Log-probabilities of the generated bytes, and of the `logprobs` likeliest at each."""
    best_of: int | None = None
    suffix: str | None = None

    def refused(self) -> dict[str, bool]:
        return {
            **super().refused(),
            "best_of": self.best_of not in (None, 1),
            "suffix": self.suffix is not None,
        }


class CompletionLogprobs(BaseModel):
    """The legacy completions shape; a token is one byte (openai_api.byte_token)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["length", "stop"] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Hop(BaseModel):
    host: str
    compute_ms: float
    """This host's compute over all traversals of the request."""


class Timings(BaseModel):
    """Where an OpenAI request's time went, in milliseconds (summed over its choices where
    they add up)."""

    queue_ms: float
    """From the request's arrival at its route to its first traversal: resolving the model
    and admitting its work."""
    prefill_ms: float
    """The first traversal: the prompt's context through the chain, up to the first bytes."""
    total_ms: float
    """Arrival to the last byte."""
    chain_ms: float
    """Inside traversals of the chain, all choices together (they run concurrently)."""
    host_compute_ms: float
    """The hosts' own compute within chain_ms; the rest is the network and waiting."""
    traversals: int
    hops: list[Hop]
    """Per host, in the order of the route."""


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    seed: int | None = None
    """The seed of choice 0 (an extension): sent back, it repeats the request's output."""
    timings: Timings | None = None
    """An extension: in the response, or the last chunk of a stream."""
