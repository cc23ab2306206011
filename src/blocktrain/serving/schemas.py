"""The router's request and response models: its own `/v1/generate` and the OpenAI-compatible
`/v1/completions`. Requests are strict (unknown fields are refused with a reason); tokens are
bytes, so `max_tokens` counts bytes and a prompt may be a string or a list of byte values."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blocktrain.model.sampler import DEFAULT_SAMPLER, DEFAULT_STEPS_PER_BLOCK, check_sampler

Prompt = str | list[int]


class _Sampling(BaseModel):
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
    sampler: str = DEFAULT_SAMPLER
    """The sampler's step between grid points, one of model.sampler.SAMPLERS (one-sweep
    models); an extension."""

    draft_bytes: int = Field(0, ge=0)
    """Speculative generation with a K = 1 model (an extension): bytes drafted on the router
    and verified per traversal; the text keeps the model's own law. 0: off."""

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, value: str) -> str:
        return check_sampler(value)


class GenerateRequest(_Sampling):
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


class CompletionRequest(_Sampling):
    """POST /v1/completions, as the OpenAI API defines it; parameters that change the output
    in ways this model cannot honour are refused rather than ignored."""

    model: str
    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    """Bytes to generate."""
    stream: bool = False
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    stop: str | list[str] | None = None
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        unsupported = {
            "n": self.n != 1,
            "echo": self.echo,
            "logprobs": self.logprobs is not None,
            "stop": bool(self.stop),
            "best_of": self.best_of not in (None, 1),
            "suffix": self.suffix is not None,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }
        bad = [name for name, yes in unsupported.items() if yes]
        if bad:
            raise ValueError(f"{bad[0]}: not supported by this server (leave it at its default)")
        return self


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: Literal["length"] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
