"""A run's history, read back for reports: one point per closed round, from an aggregator's
state folder (its ledger) or from a `blocktrain simulate` output folder (its simulate.json).

Both sources become the same `History`, so `protocol.ops.report` draws them with one code path.
The loss of a round means different things in the two sources and is labelled accordingly:

    state folder     the mean training loss the workers reported with their accepted updates
                     (self-reported: a picture of the run, not an evaluation)
    simulate folder  the from-noise CE on validation text, measured by the simulator
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blocktrain.errors import ConfigError
from blocktrain.protocol.core.participation import participation
from blocktrain.protocol.store.storage import LEDGER, StateDir


@dataclass(frozen=True)
class RoundPoint:
    block: int | None
    """None: the point is the whole model's (a simulate round spans every block)."""
    round: int
    time_s: float
    """Seconds since the run's first round opened (virtual seconds for a simulation)."""
    participation: float
    loss: float | None
    bytes_total: float
    """Bytes moved up to the end of this round (pushes and pulls)."""


@dataclass
class History:
    source: str
    kind: str
    """"state" or "simulate"."""
    loss_label: str
    points: list[RoundPoint] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    accepted: int = 0
    bytes_total: float = 0.0
    blocks: int = 0
    regime: str | None = None

    def per_block(self) -> dict[int, list[RoundPoint]]:
        out: dict[int, list[RoundPoint]] = {}
        for p in self.points:
            if p.block is not None:
                out.setdefault(p.block, []).append(p)
        return out

    def model_curve(self) -> list[tuple[float, float, float, float]]:
        """(rounds closed, time, bytes, loss) for the whole model: the simulator's CE as is; for
        a state folder, after each round of the slowest block, the mean over blocks of each
        block's latest loss (so that every block counts once)."""
        if self.kind == "simulate":
            return [
                (float(p.round + 1), p.time_s, p.bytes_total, p.loss)
                for p in self.points
                if p.block is None and p.loss is not None
            ]
        curve: list[tuple[float, float, float, float]] = []
        latest: dict[int, float] = {}
        closed: dict[int, int] = {}
        for p in sorted(self.points, key=lambda q: q.time_s):
            assert p.block is not None
            closed[p.block] = p.round + 1
            if p.loss is not None:
                latest[p.block] = p.loss
            if len(latest) == self.blocks:
                loss = sum(latest.values()) / self.blocks
                curve.append((min(closed.values()), p.time_s, p.bytes_total, loss))
        return curve


def load(path: Path, regime: str | None = None) -> History:
    """The history of an aggregator state folder or a simulate output folder."""
    path = Path(path)
    if (path / LEDGER).is_file():
        return from_state(StateDir(path))
    if (path / "simulate.json").is_file():
        return from_simulation(path / "simulate.json", regime)
    raise ConfigError(
        f"{path} is neither an aggregator state folder (no {LEDGER}) nor a simulate output "
        "folder (no simulate.json)"
    )


def from_state(state: StateDir) -> History:
    ledger = state.ledger
    hist = History(
        str(state.root), "state", "mean reported training loss (nats/byte)", blocks=state.n_blocks()
    )
    rows = ledger.rounds()
    losses = ledger.round_losses()
    for c in ledger.update_counts():
        if c["fate"] == "refused":
            hist.refusals[c["reason"] or "unknown"] += int(c["n"])
    if not rows:
        return hist
    t0 = min(r["started_at"] if r["started_at"] is not None else r["closed_at"] for r in rows)
    # Bytes: every update body by the time it arrived, plus each round's pulls, estimated as
    # one block body per worker that reported (the ledger keeps pull bytes only in totals). A
    # pull's body comes with it, or from the version's URL after a 303 ("weights"; bytes a
    # cache in front served instead never reach the ledger).
    pushed = sorted(ledger.update_arrivals())
    traffic = ledger.traffic()
    pull_bytes = sum(
        t["bytes_out"] for t in traffic if t["endpoint"] in ("pull", "weights", "delta")
    )
    pulls = sum(t["requests"] for t in traffic if t["endpoint"] == "pull") or 1
    per_pull = pull_bytes / pulls
    reported_so_far = 0
    i, pushed_bytes = 0, 0.0
    for r in sorted(rows, key=lambda r: r["closed_at"]):
        while i < len(pushed) and pushed[i][0] <= r["closed_at"]:
            pushed_bytes += pushed[i][1]
            i += 1
        reported_so_far += r["reported"]
        hist.points.append(
            RoundPoint(
                block=r["block"],
                round=r["round"],
                time_s=r["closed_at"] - t0,
                participation=participation(r["in_time"], r["expected"]),
                loss=losses.get((r["block"], r["round"])),
                bytes_total=pushed_bytes + per_pull * reported_so_far,
            )
        )
    hist.accepted = sum(r["accepted"] for r in rows)
    hist.bytes_total = sum(t["bytes_in"] + t["bytes_out"] for t in traffic)
    return hist


def from_simulation(path: Path, regime: str | None) -> History:
    report: dict[str, Any] = json.loads(path.read_text())
    regimes = report.get("regimes", {})
    if not regimes:
        raise ConfigError(f"{path} holds no regime")
    name = regime or next(iter(regimes))
    if name not in regimes:
        raise ConfigError(f"{path} has no regime {name!r}; it has {', '.join(regimes)}")
    result = regimes[name]
    hist = History(
        str(path.parent),
        "simulate",
        "from-noise CE on validation text (nats/byte)",
        blocks=int(report["config"]["model"]["blocks"]),
        regime=name,
    )
    rounds = result["rounds"]
    moved = result["bytes"]["down"] + result["bytes"]["up"]
    n = max(len(rounds), 1)
    for k, r in enumerate(rounds):
        hist.points.append(
            RoundPoint(
                block=None,
                round=int(r["round"]),
                time_s=float(r["time"]),
                participation=float(r["participation"]),
                loss=r.get("from_noise_ce"),
                # the simulator reports bytes for the whole run: spread evenly over rounds
                bytes_total=moved * (k + 1) / n,
            )
        )
        for b in r.get("blocks", []):
            hist.points.append(
                RoundPoint(
                    block=int(b["block"]),
                    round=int(r["round"]),
                    time_s=float(b["closed_at"]),
                    participation=float(b["participation"]),
                    loss=None,
                    bytes_total=moved * (k + 1) / n,
                )
            )
    hist.refusals.update(result["updates"]["refused"])
    hist.accepted = int(result["updates"]["accepted"])
    hist.bytes_total = float(moved)
    return hist
