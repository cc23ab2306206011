"""The aggregator's settings: a frozen dataclass validated on construction, saved in the state
folder next to the weights (so that a restarted aggregator runs the same protocol)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from blocktrain.errors import ConfigError
from blocktrain.protocol.aggregation import RULES
from blocktrain.protocol.wire import WIRE_DTYPES


@dataclass(frozen=True)
class AggregatorSettings:
    """How the aggregator runs rounds, validates and aggregates (DESIGN.md section 4)."""

    deadline_s: float = 60.0
    """Seconds from a round's first pull to its deadline."""
    local_steps: int = 10
    """H, the local AdamW steps a worker runs per round (told to workers at registration)."""
    staleness: int = 0
    """S: updates up to S rounds late still count (down-weighted); 0 refuses them as late."""
    stale_weight: float = 0.5
    """Weight factor per round of lateness within the staleness bound."""
    max_rounds: int | None = None
    """Rounds per block after which the block is done (None: until stopped)."""
    rule: str = "mean"
    """Aggregation: mean (token-weighted), median (coordinate-wise) or trimmed_mean."""
    trim: float = 0.1
    """Fraction trimmed at each end per coordinate by trimmed_mean."""
    outer_lr: float = 1.0
    """Outer learning rate applied to the aggregated delta (1: plain averaging)."""
    outer_momentum: float = 0.0
    """Outer Nesterov momentum (DiLoCo); 0 turns the outer optimizer off."""
    wire_dtype: str = "fp16"
    """dtype of weights and deltas on the wire: fp16, bf16 or fp32."""
    max_delta_norm: float = 100.0
    """Bound on an update's global L2 norm (the CLI derives it from lr, H and the block size)."""
    max_tokens: int = 1 << 31
    """Bound on an update's token count (the CLI derives it from H, batch and seq_len)."""
    max_body_bytes: int | None = None
    """Request body limit; None: twice the block's fp32 size plus 1 MiB."""
    n_workers: int = 1024
    """Stride of the worker data seeds: seed * n_workers + worker_id (STYLE 14)."""
    live_window_s: float | None = None
    """A worker heard from within this many seconds is live (None: 3 x deadline_s)."""
    keep_versions: int = 3
    """Committed versions kept on disk per block (0: keep all, e.g. to evaluate every round)."""

    def __post_init__(self) -> None:
        _check(self.deadline_s > 0, "deadline_s", self.deadline_s, "must be positive")
        _check(self.local_steps > 0, "local_steps", self.local_steps, "must be positive")
        _check(self.staleness >= 0, "staleness", self.staleness, "must be >= 0")
        _check(0 < self.stale_weight <= 1, "stale_weight", self.stale_weight, "must lie in (0, 1]")
        _check(
            self.max_rounds is None or self.max_rounds > 0,
            "max_rounds",
            self.max_rounds,
            "must be positive (or none)",
        )
        _check(self.rule in RULES, "rule", self.rule, f"must be one of {', '.join(RULES)}")
        _check(0 <= self.trim < 0.5, "trim", self.trim, "must lie in [0, 0.5)")
        _check(self.outer_lr > 0, "outer_lr", self.outer_lr, "must be positive")
        _check(
            0 <= self.outer_momentum < 1,
            "outer_momentum",
            self.outer_momentum,
            "must lie in [0, 1)",
        )
        _check(
            self.wire_dtype in WIRE_DTYPES,
            "wire_dtype",
            self.wire_dtype,
            f"must be one of {', '.join(WIRE_DTYPES)}",
        )
        _check(self.max_delta_norm > 0, "max_delta_norm", self.max_delta_norm, "must be positive")
        _check(self.max_tokens > 0, "max_tokens", self.max_tokens, "must be positive")
        _check(
            self.max_body_bytes is None or self.max_body_bytes > 0,
            "max_body_bytes",
            self.max_body_bytes,
            "must be positive (or none)",
        )
        _check(self.n_workers > 0, "n_workers", self.n_workers, "must be positive")
        _check(
            self.live_window_s is None or self.live_window_s > 0,
            "live_window_s",
            self.live_window_s,
            "must be positive (or none)",
        )
        _check(self.keep_versions >= 0, "keep_versions", self.keep_versions, "must be >= 0")

    @property
    def live_window(self) -> float:
        return self.live_window_s if self.live_window_s is not None else 3 * self.deadline_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AggregatorSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown aggregator setting(s): {', '.join(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> AggregatorSettings:
        """A copy with the given fields changed (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def setting_types() -> dict[str, Any]:
    return typing.get_type_hints(AggregatorSettings)


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ConfigError(f"aggregator setting {name} = {value!r} {why}")
