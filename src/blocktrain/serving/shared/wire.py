"""What travels between the router and the hosts: one safetensors body per message, whose
metadata key "blocktrain" holds a JSON header (`SweepHeader`, `StageHeader`) and whose tensors
are the state (docs/serving.md, "The wire" and "One sweep: who does what").

Logits always travel in fp32 so that sampling gives the same bytes wherever it runs; the fp16
option only narrows the state. Bodies are read by `blocktrain.tensorwire`, the aggregator's
parser (a pickle or a malformed body is refused with its reason); errors travel as JSON
(`ServingError.to_json`). Nothing is pickled.
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
    holds drafted + 1 tokens, one per position after the context. 0: one span."""
    draws: int = Field(default=1, ge=1, le=16)
    """z holds draws x (drafted + 1) tokens (verify_layout), the logits come back in that order;
    draws > 1 makes a verify sweep even with nothing drafted (the drafter may find no draft)."""
    fork: int = Field(default=0, ge=0, le=4096)
    """The grid point where a verify sweep's draws part (verify_fork): before it z holds one
    copy, from it on `draws`. 0: the draws start apart (z holds them all)."""
    session: str | None = Field(default=None, min_length=1, max_length=64)
    """Names one generation, whose clean-stream caches each host keeps. None: no cache."""
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
    """POST /v1/release, a JSON body: drop one generation's caches on this host."""

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
    """The last `verify` tokens are a draft: the last stage answers the logits of the last
    verify + 1 positions. 0: the last position's."""


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
