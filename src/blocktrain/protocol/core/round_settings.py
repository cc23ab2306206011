"""The first of the aggregator's settings, how a round runs: its deadline, the local steps H
(fixed or paced), how late an update may still count, and how many rounds a block runs. A base
of `settings.AggregatorSettings`, whose first fields these are."""

from __future__ import annotations

from dataclasses import dataclass

from blocktrain.protocol.core.declaration import positive, positive_or_none, setting
from blocktrain.protocol.core.pacing import PACINGS


@dataclass(frozen=True)
class RoundSettings:
    """How a round runs (docs/protocol.md, "Settings"); built only as `AggregatorSettings`."""

    deadline_s: float = setting(
        60.0,
        "Seconds from a round's first pull to its deadline.",
        positive,
        "must be positive",
        flag="--deadline",
        metavar="S",
    )
    local_steps: int = setting(
        10,
        "H, the local AdamW steps a worker runs per round (told to workers at registration).",
        positive,
        "must be positive",
        flag="--local-steps",
        metavar="H",
    )
    pacing: str = setting(
        "fixed",
        "fixed: every worker runs H local steps a round; adaptive: each pull tells its worker "
        "the steps that fill pacing_margin of the time left to the deadline at its measured "
        "seconds per step (between H / 8 and H), so a slow box still contributes; see "
        "docs/protocol.md, Pacing.",
        lambda v: v in PACINGS,
        f"must be one of {', '.join(PACINGS)}",
    )
    pacing_margin: float = setting(
        0.8,
        "Share of the time left to the deadline that adaptive pacing fills (the rest absorbs "
        "the jitter of steps and transfers).",
        lambda v: 0 < v <= 1,
        "must lie in (0, 1]",
    )
    staleness: int = setting(
        0,
        "S: an update up to S rounds late still counts, in the open round, with weight "
        "stale_weight ** lateness; 0 refuses every late update.",
        lambda v: v >= 0,
        "must be >= 0",
        flag="--staleness",
        metavar="S",
    )
    stale_weight: float = setting(
        0.5,
        "Weight factor per round of lateness within the staleness bound.",
        lambda v: 0 < v <= 1,
        "must lie in (0, 1]",
    )
    max_rounds: int | None = setting(
        None,
        "Rounds per block after which the block is done (none: run until stopped).",
        positive_or_none,
        "must be positive (or none)",
        simulated=False,  # --rounds
    )
