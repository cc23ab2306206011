"""A run's history, read back for reports and the dashboard, from an aggregator's state folder
(its ledger, and evals.jsonl), a simulate folder (simulate.json), a cluster folder (its state/
and summary.json) or a train run (metrics.jsonl). All become the same `History`, so
`protocol.ops.report` draws them with one code path.

Every series says what its number is: a worker's reported loss is its block's whole objective
(denoise + aux, which can sit above ln 256: `REPORTED_LOSS`), never a validation CE; validation
CEs go in `evals`, each labelled with its slice and M. Rounds lie on one axis, "rounds closed":
what round r reported sits at x = r + 1, the model after r rounds at x = r (as `cluster
--log-to`); a train run's x is the optimizer step."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blocktrain.errors import ConfigError
from blocktrain.fsutil import json_lines
from blocktrain.protocol.core.participation import participation
from blocktrain.protocol.store.storage import LEDGER, StateDir

REPORTED_LOSS = "workers' reported loss: denoise + aux_weight x next-byte aux, summed (nats/byte)"
"""The label of what a push's `loss` is (training/loss.py `BlockLoss`): not a validation CE."""
ROUNDS = "rounds closed"
STEPS = "optimizer step"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
EVAL_KEYS = {
    "from_noise_ce": "validation from-noise CE",
    "sampler_ce": "validation sampler CE",
    "joint_ce": "validation joint CE",
    "ce": "validation CE",
}
"""The keys of an eval record that are a validation CE of the whole model, and their names."""

Series = dict[str, list[tuple[int, float]]]
"""label -> (x, value) points, x on the history's one axis (`History.x_label`)."""


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
    """"state", "simulate", "cluster" or "train"."""
    loss_label: str
    """What the model curve's value is (`model_curve`)."""
    x_label: str = ROUNDS
    points: list[RoundPoint] = field(default_factory=list)
    losses: Series = field(default_factory=dict)
    """Training losses (self-reported or logged by the trainer), each labelled."""
    evals: Series = field(default_factory=dict)
    """Validation CEs, each labelled."""
    eval_time_s: dict[int, float] = field(default_factory=dict)
    """x -> seconds since the first round opened when the model after x rounds was complete
    (from the live evaluations' records; 0 for the initial model)."""
    facts: list[tuple[str, str]] = field(default_factory=list)
    """More rows for the report's summary table (a cluster's final CE, a train run's steps)."""
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

    def model_curve(self) -> list[tuple[int, float, float, float]]:
        """(rounds closed, time, bytes, loss) for the whole model, labelled `loss_label`: the
        simulator's CE as is; for a state folder, after each round of the slowest block, the
        mean over blocks of each block's latest reported loss (so that every block counts
        once); nothing for a train run."""
        if self.kind == "simulate":
            return [
                (p.round + 1, p.time_s, p.bytes_total, p.loss)
                for p in self.points
                if p.block is None and p.loss is not None
            ]
        curve: list[tuple[int, float, float, float]] = []
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
    """The history of an aggregator state folder, a simulate output folder, a cluster output
    folder or a train run folder; a ConfigError for any other folder."""
    path = Path(path)
    if (path / LEDGER).is_file():
        return _read_state(path)
    if (path / "simulate.json").is_file():
        return from_simulation(path / "simulate.json", regime)
    if (path / "state" / LEDGER).is_file():
        return from_cluster(path)
    if (path / METRICS).is_file():
        return from_train(path)
    raise ConfigError(
        f"{path} is none of an aggregator state folder (no {LEDGER}), a simulate output folder "
        f"(no simulate.json), a cluster output folder (no state/{LEDGER}) or a train run folder "
        f"(no {METRICS})"
    )


def _read_state(path: Path) -> History:
    state = StateDir(path)
    try:
        return from_state(state)
    finally:
        state.close()


def from_state(state: StateDir) -> History:
    ledger = state.ledger
    hist = History(
        str(state.root),
        "state",
        f"mean over blocks of the {REPORTED_LOSS}",
        blocks=state.n_blocks(),
    )
    rows = ledger.rounds()
    losses = ledger.round_losses()
    for c in ledger.update_counts():
        if c["fate"] == "refused":
            hist.refusals[c["reason"] or "unknown"] += int(c["n"])
    t0 = min(
        (r["started_at"] if r["started_at"] is not None else r["closed_at"] for r in rows),
        default=None,
    )
    _live_evals(hist, state, t0)
    if not rows:
        return hist
    assert t0 is not None
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
    for b, pts in sorted(hist.per_block().items()):
        series = [(p.round + 1, p.loss) for p in pts if p.loss is not None]
        if series:
            hist.losses[f"block {b}: {REPORTED_LOSS}"] = sorted(series)
    return hist


def live_label(key: str, n_bytes: Any, sweeps: Any) -> str:
    """The label of a live evaluation's series (AggregatorSettings.live_eval_every)."""
    return (
        f"{EVAL_KEYS[key]} of the committed model, live: {n_bytes} bytes, M = {sweeps} (nats/byte)"
    )


def _live_evals(hist: History, state: StateDir, t0: float | None) -> None:
    """The live evaluations of STATE/evals.jsonl, at x = the rounds every block had closed;
    the sampler CE only where it is not the from-noise CE by definition (M > 1; the record
    keeps both)."""
    for record in state.evals():
        x, sweeps = int(record["rounds"]), record.get("sweeps", "?")
        for key in EVAL_KEYS:
            value = record.get(key)
            if not isinstance(value, int | float) or (key == "sampler_ce" and sweeps == 1):
                continue
            label = live_label(key, record.get("bytes", "?"), sweeps)
            hist.evals.setdefault(label, []).append((x, float(value)))
        at = record.get("at")
        if x == 0:
            hist.eval_time_s[x] = 0.0
        elif isinstance(at, int | float) and t0 is not None:
            hist.eval_time_s[x] = max(0.0, at - t0)
    for label in hist.evals:
        hist.evals[label].sort()


def from_cluster(path: Path) -> History:
    """A cluster output folder: its state/, and the validation CE of each round's model from
    its summary.json (absent while the rounds run: then the training losses only)."""
    hist = _read_state(path / "state")
    hist.kind, hist.source = "cluster", str(path)
    summary_path = path / SUMMARY
    if not summary_path.is_file():
        live = " (the live evaluations are plotted)" if hist.evals else ""
        hist.facts.append(
            (
                "validation CE after the rounds",
                f"none yet (no {SUMMARY}: the evaluation after the rounds has not run){live}",
            )
        )
        return hist
    try:
        summary: dict[str, Any] = json.loads(summary_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{summary_path} is not readable JSON: {exc}") from exc
    per_round = summary.get("per_round_eval") or {}
    where = f"{per_round.get('bytes', '?')} bytes, M = {per_round.get('sweeps', '?')}"
    for key in ("from_noise_ce", "sampler_ce"):
        values = summary.get(f"{key}_per_round") or []
        if values:  # values[r]: the model after r rounds
            hist.evals[f"{EVAL_KEYS[key]}, {where} (nats/byte)"] = [
                (r, float(v)) for r, v in enumerate(values) if isinstance(v, int | float)
            ]
    final = summary.get("final") or {}
    for key in ("sampler_ce", "from_noise_ce"):
        if isinstance(final.get(key), int | float):
            label = f"final {EVAL_KEYS[key]}"
            hist.facts.append(
                (f"{label} (M = {final.get('sweeps', '?')})", f"{final[key]:.4f} nats/byte")
            )
    return hist


def from_train(path: Path) -> History:
    """A train run folder, from its metrics.jsonl: each block's loss components by step (the
    sum too, labelled as one, only where no component is logged) and the validation CE."""
    hist = History(str(path), "train", "", x_label=STEPS)
    last_step = 0
    for _, record in json_lines(path / METRICS, ConfigError):
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        step = int(record["step"])
        last_step = max(last_step, step)
        if record.get("event") == "train":
            for label, value in _train_losses(record).items():
                hist.losses.setdefault(label, []).append((step, value))
        elif record.get("event") == "eval" and record.get("split") == "valid":
            for key, label in EVAL_KEYS.items():
                if isinstance(record.get(key), int | float):
                    hist.evals.setdefault(f"{label} (nats/byte)", []).append(
                        (step, float(record[key]))
                    )
    blocks = {label.split(":")[0] for label in hist.losses if label.startswith("block ")}
    hist.blocks = len(blocks) or (1 if hist.losses else 0)
    hist.facts.append(("steps logged", str(last_step)))
    return hist


def _train_losses(record: dict[str, Any]) -> dict[str, float]:
    """A train record's losses, labelled: per block (keys b0_loss_denoise, b0_loss_aux, b0_loss,
    or without the prefix for a one-unit run) its denoise and next-byte aux CEs, apart."""
    out: dict[str, float] = {}
    prefixes = sorted(
        {k[: -len("loss")] for k in record if k.startswith("b") and k.endswith("_loss")}
    ) or [""]
    for prefix in prefixes:
        who = f"block {prefix[1:-1]}: " if prefix else ""
        parts = {
            "loss_denoise": "denoise loss (nats/byte)",
            "loss_aux": "next-byte aux CE, unweighted (nats/byte)",
        }
        found = False
        for key, label in parts.items():
            if isinstance(record.get(prefix + key), int | float):
                out[who + label] = float(record[prefix + key])
                found = True
        if not found and isinstance(record.get(prefix + "loss"), int | float):
            out[who + "training loss (nats/byte)"] = float(record[prefix + "loss"])
    return out


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
        "validation from-noise CE, measured by the simulator (nats/byte)",
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
    curve = [(c[0], c[3]) for c in hist.model_curve()]
    if curve:
        hist.evals[hist.loss_label] = curve
    return hist
