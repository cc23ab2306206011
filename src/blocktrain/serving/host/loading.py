"""What a host loads: only its blocks (and the frozen table E, which every host's steps need) or
reference stages of a run folder, read tensor by tensor, so a host never holds the whole model.
A reference's layers are split into as many stages as the config has blocks, so the baseline
runs on the same number of hosts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from blocktrain.config import RunConfig
from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.model import BlockStack, SigmaSchedule, init_reference
from blocktrain.model.heads import HeadStage
from blocktrain.model.pipeline import ReferenceStage, stage_layers
from blocktrain.training.checkpoint import (
    FORMAT,
    MODEL_FILE,
    RunInfo,
    atomic_save_tensors,
    load_module_tensors,
    read_config,
    write_config,
)


@dataclass(frozen=True)
class ModelSource:
    """A run folder a host serves, under a model name."""

    name: str
    run_dir: Path

    @staticmethod
    def parse(text: str) -> ModelSource:
        """'RUN_DIR' (named after the folder) or 'NAME=RUN_DIR'."""
        name, sep, path = text.partition("=")
        if not sep:
            name, path = Path(text).resolve().name, text
        name = name.strip()
        if not name or not path or any(c in name for c in " /\\\"'"):
            raise ConfigError(
                f"model {text!r}: expected RUN_DIR or NAME=RUN_DIR with a plain "
                "NAME (no spaces, slashes or quotes)"
            )
        return ModelSource(name, Path(path))


@dataclass
class HostedModel:
    """One model as a host holds it: some blocks of a BlockTrain run, or some stages of a
    reference."""

    name: str
    kind: str  # "blocktrain" or "reference"
    config: RunConfig
    parts: list[int]  # block indices, or stage indices
    total: int  # B: blocks in the run, or stages of the reference
    fingerprint: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where its blocks or stages run; the host moves each request's tensors here and the
    answers back to the CPU for the wire."""
    stack: BlockStack | None = None
    stages: dict[int, ReferenceStage] = field(default_factory=dict)
    head_stages: dict[int, HeadStage] = field(default_factory=dict)
    """A route = features run's blocks as stages of its head exit (model/heads.py)."""
    _grids: dict[int, list[tuple[int, float]]] = field(default_factory=dict, repr=False)

    def grid(self, steps_per_block: int) -> list[tuple[int, float]]:
        """The sampler grid every host derives identically from the run's config."""
        if steps_per_block not in self._grids:
            schedule = SigmaSchedule.from_config(self.config.model)
            self._grids[steps_per_block] = schedule.sampler_grid(steps_per_block)
        return self._grids[steps_per_block]

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "parts": self.parts,
            "total": self.total,
            "fingerprint": self.fingerprint,
            "config": self.config.to_dict(),
        }


def fingerprint(info: RunInfo, step: str) -> str:
    """Identifies a run's weights: its config, kind and the step the weights are from. Hosts
    refuse state from a router that resolved the model to another fingerprint."""
    doc = json.dumps(
        {"config": info.config.to_dict(), "kind": info.kind, "step": step}, sort_keys=True
    )
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _read_selected(path: Path, wanted: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors whose names start with one of `wanted` (or equal it), and the metadata."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            every = f.keys()  # a safe_open handle: `in f` does not work
            names = [k for k in every if any(k == w or k.startswith(w) for w in wanted)]
            return {k: f.get_tensor(k) for k in names}, meta
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from exc


def load_hosted_model(
    source: ModelSource, parts: list[int], device: torch.device | str = "cpu"
) -> HostedModel:
    """Load blocks `parts` of a BlockTrain run, or stages `parts` of a reference run, onto
    `device`."""
    device = torch.device(device)
    info = read_config(source.run_dir)
    cfg = info.config
    path = Path(source.run_dir) / MODEL_FILE
    total = cfg.model.blocks
    what = "block" if info.kind == "blocktrain" else "stage"
    for p in parts:
        if not 0 <= p < total:
            raise ConfigError(f"--blocks {p}: {source.run_dir} has {what}s 0..{total - 1}")
    if info.kind == "blocktrain":
        missing = sorted(set(parts) - set(info.blocks))
        if missing:
            raise CheckpointError(
                f"{source.run_dir} holds the weights of blocks {info.blocks}, "
                f"not of block(s) {missing}"
            )
        tensors, meta = _read_selected(path, ["targets", *(f"block.{b}." for b in parts)])
    else:
        wanted = [prefix for s in parts for prefix in stage_prefixes(cfg, s, total)]
        tensors, meta = _read_selected(path, wanted)
    if meta.get("format") != FORMAT or meta.get("kind") != info.kind:
        raise CheckpointError(f"{path} is not this run's BlockTrain weights")
    model = HostedModel(
        source.name,
        info.kind,
        cfg,
        sorted(parts),
        total,
        fingerprint(info, meta.get("step", "")),
        device,
    )
    with torch.no_grad():
        if info.kind == "blocktrain":
            stack = BlockStack(cfg.model, cfg.seed, sorted(parts))
            for b in stack.block_ids:
                load_module_tensors(stack.block(b), tensors, f"block.{b}.", path)
            if "targets" not in tensors or tensors["targets"].shape != stack.targets.shape:
                raise CheckpointError(f"{path} has no usable target table")
            stack.targets.copy_(tensors["targets"])
            model.stack = stack.to(device).eval()
            if cfg.model.reads_upstream and cfg.model.aux_weight > 0:  # the head exit
                model.head_stages = {
                    b: HeadStage(stack.block(b), last=b == total - 1) for b in stack.block_ids
                }
        else:
            for s in sorted(parts):
                stage = ReferenceStage(cfg.model, s, total)
                load_module_tensors(
                    stage, _stage_tensors(tensors, cfg, s, total), "reference.", path
                )
                model.stages[s] = stage.to(device).eval()
    return model


def stage_prefixes(cfg: RunConfig, stage: int, stages: int) -> list[str]:
    """The reference tensor-name prefixes that stage `stage` of `stages` holds."""
    out = [f"reference.layers.{i}." for i in stage_layers(cfg.model, stage, stages)]
    if stage == 0:
        out.append("reference.embed.")
    if stage == stages - 1:
        out += ["reference.norm.", "reference.head."]
    return out


def _stage_tensors(
    tensors: dict[str, torch.Tensor], cfg: RunConfig, stage: int, stages: int
) -> dict[str, torch.Tensor]:
    prefixes = stage_prefixes(cfg, stage, stages)
    return {k: v for k, v in tensors.items() if any(k.startswith(p) for p in prefixes)}


def write_untrained_run(cfg: RunConfig, run_dir: Path, kind: str = "blocktrain") -> Path:
    """A run folder holding freshly initialised (untrained) weights: what the serving benchmark
    and `plan --throughput` time. Quality is meaningless; the shapes and the work are real."""
    run_dir = Path(run_dir)
    info = RunInfo(cfg, kind, [] if kind == "reference" else list(range(cfg.model.blocks)))
    weights: dict[str, torch.Tensor] = {}
    if kind == "reference":
        ref = init_reference(cfg.model, cfg.seed)
        weights.update({f"reference.{k}": v for k, v in ref.state_dict().items()})
    else:
        stack = BlockStack(cfg.model, cfg.seed)
        for b in stack.block_ids:
            weights.update({f"block.{b}.{k}": v for k, v in stack.block(b).state_dict().items()})
        weights["targets"] = stack.targets
    write_config(run_dir, info)
    atomic_save_tensors(
        run_dir / MODEL_FILE, weights, {"format": FORMAT, "kind": kind, "step": "0"}
    )
    return run_dir
