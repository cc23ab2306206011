"""An aggregator's state folder as runs use it: created for a run config (version 0 comes from
the caller: this package never builds a model), read back as the committed blocks of each
round, and the cluster summary's byte accounting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import RunConfig
from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.protocol.core.local_trainer import UNITS
from blocktrain.protocol.store.storage import StateDir

Tensors = dict[str, torch.Tensor]


def run_unit(run_config: dict[str, Any]) -> str:
    """The unit of a state folder's run (`UNITS`); runs from before the choice train blocks."""
    return str(run_config.get("unit", "block"))


def create_state(
    state_dir: Path,
    cfg: RunConfig,
    overrides: dict[str, Any],
    blocks: dict[int, Tensors],
    unit: str = "block",
) -> StateDir:
    """A new state folder for `cfg` starting from `blocks` (version 0), with the settings'
    norm and token bounds derived from the run unless `overrides` gives them; `unit`: what
    its workers train (`UNITS`)."""
    if unit not in UNITS:
        raise ConfigError(f"unit {unit!r}: choose one of {', '.join(UNITS)}")
    settings = derived_settings(cfg, overrides, largest_block(blocks))
    if unit == "reference" and settings.effect_probe == "on":
        raise ConfigError(
            "a reference (DiLoCo) run takes --effect-probe off: the probe judges blocks"
        )
    run_config = cfg.to_dict() if unit == "block" else {**cfg.to_dict(), "unit": unit}
    return StateDir.create(state_dir, run_config=run_config, settings=settings, blocks=blocks)


@dataclass(frozen=True)
class Committed:
    """Committed blocks read back from a state folder."""

    cfg: RunConfig
    blocks: dict[int, Tensors]
    versions: dict[int, int]
    """The committed version of each block read."""
    rounds: dict[int, int]
    """Each block's open round (= rounds closed so far)."""
    step: int
    """Local steps per replica the slowest block has seen: its rounds x H."""
    unit: str = "block"
    """What the run's workers train (`UNITS`)."""


def read_committed(state_dir: Path, versions: dict[int, int] | None = None) -> Committed:
    """Each block's latest committed version (or the given `versions`), with the run config."""
    state = StateDir(Path(state_dir))
    try:
        cfg = RunConfig.from_dict(state.run_config())
        unit = run_unit(state.run_config())
        local_steps = state.settings().local_steps
        chosen: dict[int, int] = {}
        rounds: dict[int, int] = {}
        for b in range(state.n_blocks()):
            version, round_, _ = state.ledger.block_state(b)
            chosen[b] = versions[b] if versions is not None else version
            rounds[b] = round_
        blocks = {b: state.load_tensors(b, v) for b, v in chosen.items()}
    finally:
        state.close()
    if len(blocks) != cfg.model.blocks:
        raise CheckpointError(
            f"{state_dir} holds {len(blocks)} blocks; its config has {cfg.model.blocks}"
        )
    return Committed(cfg, blocks, chosen, rounds, min(rounds.values()) * local_steps, unit)


def round_versions(state: StateDir, rounds: int) -> list[dict[int, int]]:
    """versions[r][b]: the version of block b after r closed rounds (r = 0: the init)."""
    table = {(r["block"], r["round"]): r["new_version"] for r in state.ledger.rounds()}
    out = []
    for r in range(rounds + 1):
        out.append({b: 0 if r == 0 else table[(b, r - 1)] for b in range(state.n_blocks())})
    return out


def bytes_summary(
    status: dict[str, Any], wire_bytes: dict[int, int], delta_bytes: dict[int, int] | None = None
) -> dict[str, Any]:
    """Bytes moved against the minimum: one pull (`wire_bytes`, or the compressed `pull_bytes`)
    and one delta upload (`delta_bytes`, default `wire_bytes`) per worker per round it pushed in.
    The orchestrator's status polls are left out."""
    up_bytes = delta_bytes or wire_bytes
    by_endpoint = status["bytes"]["by_endpoint"]
    protocol = {ep: v for ep, v in by_endpoint.items() if ep != "status"}
    down = sum(v["bytes_out"] for v in protocol.values())
    up = sum(v["bytes_in"] for v in protocol.values())
    pushes = {int(b): 0 for b in wire_bytes}
    for b, rounds in status["participation"].items():
        pushes[int(b)] = sum(r["reported"] for r in rounds)
    minimum = sum((wire_bytes[b] + up_bytes[b]) * n for b, n in pushes.items())
    return {
        "total": down + up,
        "down": down,
        "up": up,
        "minimum": minimum,
        "worker_rounds": sum(pushes.values()),
        "ratio_to_minimum": (down + up) / minimum if minimum else None,
        "status_polls": by_endpoint.get("status", {}),
        "by_endpoint": protocol,
        "note": "HTTP bodies only (headers and TCP/IP framing not counted); minimum = "
        "(pull bytes + delta bytes) per worker per round, a pull being the block's weights or, "
        "with compressed pulls, a delta (each worker's first pull is whole: above the minimum)",
    }
