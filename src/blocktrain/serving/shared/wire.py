"""What travels between the router and the hosts: one safetensors body per message.

A request body is a safetensors file whose metadata key "blocktrain" holds a JSON header
(`SweepHeader` or `StageHeader`) and whose tensors are the state:

    POST /v1/sweep   x (N, Lx) uint8       the clean context bytes of the span (and a draft)
                     z (N, K, d) fp32|fp16 the noisy state at grid point `step`
                                           ((N, M (D + 1), d) for a verify sweep of D drafted, M draws;
                                           (N, D + 1, d) before its `fork`)
                     u (N, Lx, d) fp32|fp16 a `route = features` run past block 0: the
                                           previous block's clean output at every context
                                           position (docs/model.md)
                     generator (S,) uint8  the request's torch.Generator state, when a host
                                           draws from it (final = "bytes", or a sampler
                                           whose steps draw noise); it comes back advanced
    POST /v1/stage   x (N, L) uint8        new bytes (to the first stage), or
                     h (N, L, d) fp32|fp16 hidden states (to the later stages)
                     generator (S,) uint8  as above

A sweep's header may name its generation (`session`): each host keeps its blocks' clean streams
under it and reuses them as far as the next sweep's context repeats the cached bytes
(host/sessions.py, model/cached.py).

A final answer is a safetensors body too: `logits` (N, K, 256) fp32 for a sweep, (N, 256) for a
stage step; or `bytes` (N, K) / (N,) uint8 and the advanced `generator` state when the last host
samples. Logits always travel in fp32 so that sampling gives the same bytes wherever it runs;
the fp16 option only narrows the state. Every host adds a line to the `x-blocktrain-trace`
response header (JSON list) saying what it computed and for how long.

Bodies are read by `blocktrain.tensorwire`, the parser the aggregator uses too (a pickle or a
malformed body is refused with its reason). Errors travel as JSON
(`serving_errors.ServingError.to_json`), never as safetensors. Nothing is pickled.

    POST /v1/release {"model", "session"}  (JSON) drop a generation's caches on this host
"""

from __future__ import annotations

import json
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from blocktrain import tensorwire
from blocktrain.model.sampler import check_sampler
from blocktrain.tensorwire import CONTENT_TYPE, WireError

__all__ = ["CONTENT_TYPE", "WIRE_DTYPES", "WireError", "decode", "encode"]

HEADER_KEY = "blocktrain"
TRACE_HEADER = "x-blocktrain-trace"
WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}
WireDtype = Literal["fp32", "fp16"]
Final = Literal["logits", "bytes"]


class SamplingSpec(BaseModel):
    """How the last host draws bytes when asked to (mirrors model.Sampling)."""

    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=256)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    utf8: bool = False
    """The request keeps its text valid UTF-8 (model/utf8.py): its final bytes are drawn on the
    router, which holds the whole context, so final = bytes with utf8 is refused."""


class _Header(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=200)
    """The model's name on the hosts."""
    fingerprint: str = Field(min_length=1, max_length=64)
    """The run the router resolved the model to; a host serving another run refuses."""
    final: Final = "logits"
    """What the last host returns: the final logits, or bytes sampled with `generator`."""
    sampling: SamplingSpec | None = None
    wire_dtype: WireDtype = "fp32"
    """The dtype of the state (z or h) on the wire."""


class SweepHeader(_Header):
    step: int = Field(ge=0)
    """Index of the next sigma-grid point to run."""
    steps_per_block: int = Field(1, ge=1, le=64)
    sampler: str = "euler"
    """The step between grid points (model.sampler.SAMPLERS)."""
    drafted: int = Field(default=0, ge=0, le=62)
    """A verify sweep (model.speculative): the last `drafted` bytes of x are a draft, and z
    holds drafted + 1 tokens, one per position after the context (K = 1 models; the last host
    answers logits (N, drafted + 1, 256)). 0: an ordinary sweep of one span."""
    draws: int = Field(default=1, ge=1, le=16)
    """In a verify sweep z holds draws x (drafted + 1) tokens, the positions after the context
    `draws` times over, each an independent sweep that shares the clean stream
    (model.speculative.verify_layout); the logits come back in the same order. draws > 1 makes
    a sweep a verify sweep even with nothing drafted (the drafter may find no draft)."""
    fork: int = Field(default=0, ge=0, le=4096)
    """The grid point where a verify sweep's draws part (model.speculative.verify_fork): before
    it z holds one copy of the drafted + 1 tokens, from it on `draws` copies, each drawn its own
    state by the ancestral step into the point. 0: the draws start apart (z holds them all)."""
    session: str | None = Field(default=None, min_length=1, max_length=64)
    """Names one generation: each host keeps its blocks' clean-stream caches under it and
    reuses them as far as the next sweep's context repeats the cached bytes. None: no cache."""
    close: bool = False
    """The generation's last sweep: the hosts drop its caches afterwards."""

    @property
    def verifies(self) -> bool:
        """A verify sweep: z tokens laid out by model.speculative.verify_layout."""
        return self.drafted > 0 or self.draws > 1

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, value: str) -> str:
        return check_sampler(value)


class Release(BaseModel):
    """POST /v1/release, a JSON body: drop one generation's caches on this host (one that
    ended without a closing message)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=200)
    session: str = Field(min_length=1, max_length=64)


class StageHeader(_Header):
    stage: int = Field(0, ge=0)
    """Index of the next reference stage to run."""
    session: str = Field(min_length=1, max_length=64)
    """Names one generation's KV caches on every stage."""
    pos: int = Field(ge=0)
    """How many positions the stage caches already hold (0 starts a fresh cache)."""
    close: bool = False
    """Drop the caches after this step (the generation's last byte)."""
    verify: int = Field(default=0, ge=0, le=62)
    """The last `verify` tokens are a draft (speculative decoding): the last stage answers the
    logits of the last verify + 1 positions, (N, verify + 1, 256). 0: the last position's."""


class TraceEntry(BaseModel):
    host: str
    model: str
    parts: list[int]
    compute_ms: float


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any] | None = None) -> bytes:
    return tensorwire.encode(tensors, {HEADER_KEY: json.dumps(header or {}, separators=(",", ":"))})


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """-> (tensors, header). Raises WireError with the reason for anything malformed."""
    decoded = tensorwire.decode(data)
    try:
        header = json.loads(decoded.metadata.get(HEADER_KEY, "{}"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WireError("bad_metadata", f"the message header is not JSON ({exc})") from None
    except RecursionError:  # JSON nested deeper than the parser's recursion limit
        raise WireError("bad_metadata", "the message header is nested too deeply") from None
    if not isinstance(header, dict):
        raise WireError("bad_metadata", "the message header is not a JSON object")
    return decoded.to_torch(), header


def bytes_tensor(t: torch.Tensor) -> torch.Tensor:
    """Byte values (any integer dtype) -> uint8 for the wire."""
    return t.to(torch.uint8)


def trace_from_header(value: str | None) -> list[TraceEntry]:
    if not value:
        return []
    try:
        return [TraceEntry.model_validate(item) for item in json.loads(value)]
    except (TypeError, ValueError, RecursionError):
        return []


def trace_to_header(entries: list[TraceEntry]) -> str:
    return json.dumps([e.model_dump() for e in entries], separators=(",", ":"))
