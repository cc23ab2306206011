"""Run folders (README.md, "A run folder"): config.json, weights and optimizer state as
safetensors, written atomically. Nothing here unpickles: tensors live in safetensors only,
everything else in JSON."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from blocktrain.config import RunConfig
from blocktrain.errors import BlockTrainError, CheckpointError, ConfigError
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.model import BlockStack, Reference, init_reference

FORMAT = "blocktrain"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"
UPSTREAM_FILE = "upstream.safetensors"


@dataclass(frozen=True)
class RunInfo:
    """What config.json says about a run."""

    config: RunConfig
    kind: str  # "blocktrain" or "reference"
    blocks: list[int]  # blocks whose weights this run holds (empty for a reference)


def atomic_save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    atomic_write_bytes(path, data)


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load a safetensors file and its metadata; anything unreadable is a CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        return load_file(str(path)), metadata
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from exc


def config_doc(info: RunInfo) -> dict[str, Any]:
    """config.json of a run (an export adds the Hub's keys before these)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": info.kind,
        "blocks": info.blocks,
        **info.config.to_dict(),
    }


def write_config(run_dir: Path, info: RunInfo) -> None:
    atomic_write_bytes(
        run_dir / CONFIG_FILE, (json.dumps(config_doc(info), indent=2) + "\n").encode()
    )


def read_config(run_dir: Path) -> RunInfo:
    """Read RUN_DIR/config.json, refusing anything that is not a BlockTrain run."""
    path = Path(run_dir) / CONFIG_FILE
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"run folder {run_dir} does not exist")
    if not path.is_file():
        raise CheckpointError(
            f"{run_dir} is not a BlockTrain run folder or export (no {CONFIG_FILE})"
        )
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt ({exc})") from exc
    if isinstance(doc, dict) and doc.get("format") != FORMAT and "model_type" in doc:
        raise CheckpointError(
            f"{run_dir} holds a Hugging Face model of model_type {doc['model_type']!r}, not a "
            "BlockTrain run or export"
        )
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a BlockTrain config (no format: {FORMAT})")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {doc.get('format_version')}; "
            f"this blocktrain reads version {FORMAT_VERSION}"
        )
    kind = doc.get("kind")
    if kind not in ("blocktrain", "reference"):
        raise CheckpointError(f"{path} has unknown kind {kind!r}")
    try:
        config = RunConfig.from_dict(doc)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    blocks = doc.get("blocks", [])
    if not isinstance(blocks, list) or not all(isinstance(b, int) for b in blocks):
        raise CheckpointError(f"{path}: 'blocks' must be a list of block indices")
    return RunInfo(config=config, kind=kind, blocks=sorted(blocks))


def upstream_blocks(cfg: RunConfig, blocks: list[int]) -> list[int]:
    """The blocks a run of `blocks` reads but does not train: under `route = features` those
    before its last block that it does not hold (each block reads the clean streams of all the
    blocks before it); none under `route = state`."""
    if cfg.model.route == "state" or not blocks:
        return []
    return [b for b in range(max(blocks)) if b not in blocks]


def gather_upstream(
    sources: list[Path], cfg: RunConfig, needed: list[int]
) -> dict[str, torch.Tensor]:
    """The weights ("block.{b}.*") of the blocks `needed`, from the run folders `sources` (the
    first that holds a block gives it). Each must be a BlockTrain run of this model config and
    seed: another seed's blocks denoise towards another target table."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for source in sources:
        info = read_config(source)
        if (
            info.kind != "blocktrain"
            or info.config.model != cfg.model
            or info.config.seed != cfg.seed
        ):
            raise ConfigError(
                f"--upstream {source} is a {info.kind} run of another model config or seed; the "
                "blocks upstream must come from a BlockTrain run of this config and seed"
            )
        weights, _ = load_tensors(Path(source) / MODEL_FILE)
        for b in info.blocks:
            if b in needed and b not in found:
                prefix = f"block.{b}."
                found[b] = {k: v for k, v in weights.items() if k.startswith(prefix)}
    missing = [b for b in needed if b not in found]
    if missing:
        raise ConfigError(
            f"no --upstream run holds block(s) {missing}, which the blocks trained here read "
            "(route = features); give a run folder that does (e.g. one of `train --block "
            f"{missing[0]}`)"
        )
    return {k: v for b in needed for k, v in found[b].items()}


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    atomic_write_bytes(run_dir / STATE_FILE, (json.dumps(state, indent=2) + "\n").encode())


def read_state(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} holds no checkpoint yet (no {STATE_FILE})")
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt ({exc})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path} is corrupt (no step)")
    return state


def load_module_tensors(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str, source: Path
) -> None:
    """Copy `prefix`-named tensors into `module`, checking names and shapes exactly."""
    own = module.state_dict()
    found = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing = sorted(set(own) - set(found))
    extra = sorted(set(found) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"{source} does not match this model ({len(missing)} missing, {len(extra)} "
            f"unexpected tensors under {prefix!r}, e.g. {(missing or extra)[0]!r})"
        )
    for name, value in found.items():
        if value.shape != own[name].shape:
            raise CheckpointError(
                f"{source}: {prefix}{name} has shape {tuple(value.shape)}, "
                f"the model expects {tuple(own[name].shape)}"
            )
    module.load_state_dict(found)


def check_run_dir_free(run_dir: Path, *, overwrite: bool, resumable: bool = True) -> None:
    """Refuse to start a new run over an existing one unless asked to overwrite; the message
    offers --resume only to a command that has it (`resumable`: train, distill)."""
    if (run_dir / CONFIG_FILE).exists() and not overwrite:
        resume = "--resume to continue it, " if resumable else ""
        raise BlockTrainError(
            f"{run_dir} already holds a run; pass {resume}--overwrite to "
            f"{'start over' if resumable else 'replace it'}, or choose another --out"
        )


def load_model(
    run_dir: Path, device: torch.device | str = "cpu"
) -> tuple[RunInfo, BlockStack | Reference]:
    """The trained model of a run folder, in eval mode: a BlockStack with the blocks the run
    holds, or the reference."""
    run_dir = Path(run_dir)
    info = read_config(run_dir)
    weights, meta = load_tensors(run_dir / MODEL_FILE)
    if meta.get("format") != FORMAT or meta.get("kind") != info.kind:
        raise CheckpointError(f"{run_dir / MODEL_FILE} is not this run's BlockTrain weights")
    model: BlockStack | Reference
    if info.kind == "reference":
        model = init_reference(info.config.model, info.config.seed)
        load_module_tensors(model, weights, "reference.", run_dir / MODEL_FILE)
    else:
        model = BlockStack(info.config.model, info.config.seed, info.blocks)
        for b in model.block_ids:
            load_module_tensors(model.block(b), weights, f"block.{b}.", run_dir / MODEL_FILE)
        if "targets" not in weights or weights["targets"].shape != model.targets.shape:
            raise CheckpointError(f"{run_dir / MODEL_FILE} has no usable target table")
        model.targets.copy_(weights["targets"])
    return info, model.to(device).eval()


def iter_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl, in order."""
    path = Path(run_dir) / METRICS_FILE
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop the metric lines logged after `step`, the checkpoint a run resumes from (a crash can
    leave some), so that the log reads like an uninterrupted run's."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
    atomic_write_bytes(path, ("\n".join(kept) + "\n" if kept else "").encode())
