"""What a worker says: each round it trained as a `RoundOutcome` (its line, and a hint when the
update came late) and, at the end, its `WorkerReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LATE_HINT = "raise the aggregator's --deadline or lower its --local-steps"
"""What fixes updates that arrive after their round closed (flags of `blocktrain aggregator` and
`cluster`, protocol/core/settings.py: `deadline_s`, `local_steps`)."""
PACING_HINT = {
    "fixed": "run it with --set pacing=adaptive",
    "adaptive": "lower its --set pacing_margin",
}
"""And, by the aggregator's `pacing`: what sizes each worker's steps to the deadline."""


@dataclass(frozen=True)
class RoundOutcome:
    """One round a worker trained and pushed, as it saw it."""

    round: int
    block: int
    steps: int
    seconds: float
    """Wall time of the local steps."""
    tokens: int
    """Bytes trained on (one token is one byte)."""
    loss: float
    accepted: bool
    reason: str = ""
    """The refusal's reason code (verdict.REASONS); empty when accepted."""
    detail: str = ""
    deadline_in: float | None = None
    """Seconds left of the round when the worker pulled it (None: its clock had not started)."""
    weight: float = 1.0
    """An accepted update's staleness factor (below 1: it counted late, in a later round)."""
    counts_in: int | None = None
    elapsed: float | None = None
    """Wall time from the pull's answer to the push's answer."""
    pacing: str = "fixed"
    """The aggregator's `pacing` (adaptive: `steps` is what the pull told)."""

    @property
    def bytes_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def late(self) -> bool:
        """Refused as late, or accepted into a later round at a reduced weight."""
        return self.reason == "late" or (
            self.accepted and self.counts_in is not None and self.counts_in > self.round
        )

    def verdict(self) -> str:
        if not self.accepted:
            return f"refused: {self.reason}" + (f" ({self.detail})" if self.detail else "")
        if self.counts_in is not None and self.counts_in > self.round:
            return f"accepted late, in round {self.counts_in} at weight {self.weight:.2f}"
        return "accepted"

    def hint(self) -> str | None:
        """What to change, when the update came late."""
        if not self.late:
            return None
        timing = f"{self.steps} local steps took {self.seconds:.1f}s"
        if self.elapsed is not None:
            timing += f", the push came {self.elapsed:.1f}s after the pull"
        if self.deadline_in is not None:
            timing += f", the round had {self.deadline_in:.1f}s left at the pull"
        closed_early = (  # a second's margin for the transfers around the measured time
            self.deadline_in is not None
            and self.elapsed is not None
            and self.elapsed + 1.0 < self.deadline_in
            and "reached its deadline" not in self.detail
        )
        if closed_early:
            return (
                f"the round closed before its deadline ({timing}): the other replicas' quorum "
                "and grace closed it; raise the aggregator's --set grace_s or quorum, or lower its "
                "--local-steps"
            )
        pace = PACING_HINT.get(self.pacing, PACING_HINT["fixed"])
        return f"updates arrive after the round's deadline ({timing}): {LATE_HINT}, or {pace}"

    def lines(self) -> list[str]:
        """The round's line, and its hint's."""
        rate = self.bytes_per_s
        speed = "-" if rate is None else f"{rate:,.0f}"
        line = (
            f"round {self.round} (block {self.block}): {self.steps} steps in "
            f"{self.seconds:.{2 if self.seconds < 1 else 1}f}s, {speed} bytes/s, loss "
            f"{self.loss:.3f}; {self.verdict()}"
        )
        hint = self.hint()
        return [line] if hint is None else [line, f"  hint: {hint}"]

    def record(self) -> dict[str, Any]:
        """The round's line as a metrics record at step = its round (`worker --log-to`,
        training/tracking.py: scalars `worker/loss`, ...): its numbers, the verdict as
        `accepted` 1 or 0 (`late` 1 when it came late) and a refusal as `refused/REASON` 1."""
        record: dict[str, Any] = {
            "event": "worker",
            "step": self.round,
            "block": self.block,
            "steps": self.steps,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "bytes_per_s": self.bytes_per_s,
            "loss": self.loss,
            "accepted": int(self.accepted),
            "late": int(self.late),
        }
        if self.accepted:
            record["weight"] = self.weight
        else:
            record["refused"] = {self.reason: 1}
        return record


@dataclass
class WorkerReport:
    """What a worker did, for logs and the cluster summary."""

    worker_id: int | None = None
    block: int | None = None
    rounds: int = 0
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    local_steps: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_stream_down: int = 0
    """Of bytes_down, the relayed streams it trained on (route = relay)."""
    bytes_stream_up: int = 0
    """Of bytes_up, the streams it relayed."""
    last_loss: float | None = None
    late: int = 0
    """Rounds whose update came late (refused as `late`, or counted in a later round)."""
    stopped_by: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
