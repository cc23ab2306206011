"""The Hugging Face Hub layout of a trained model (README.md, "Exports for the Hugging Face Hub"):
what `blocktrain export --hf DIR` writes, and what `blocktrain.from_pretrained(DIR)` (or
`load_hf`) reads back. Its config.json is a run folder's with the Hub's keys added, so
everything that reads a run folder reads an export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from blocktrain.data.provenance import DATA_FILE, read_record
from blocktrain.errors import CheckpointError
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.model import BlockStack, Reference
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.card import blocktrain_version, model_card, run_facts

MODEL_TYPE = "blocktrain"
ARCHITECTURES = {"blocktrain": "BlockTrainBlockStack", "reference": "BlockTrainReference"}
CARD_FILE = "README.md"
# other libraries' weights files, which unpickle: named in the refusal, never opened
PICKLED = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.bin.index.json")

Tensors = dict[str, torch.Tensor]
Model = BlockStack | Reference


def model_tensors(model: Model) -> Tensors:
    """A loaded model's weights as a run folder names them."""
    if isinstance(model, Reference):
        return {f"reference.{k}": v for k, v in model.state_dict().items()}
    out: Tensors = {}
    for b in model.block_ids:
        out.update({f"block.{b}.{k}": v for k, v in model.block(b).state_dict().items()})
    out["targets"] = model.targets
    return out


def check_hf_dir_free(out: Path, *, overwrite: bool) -> None:
    """Refuse to write over a model already in `out` (its config.json or weights) unless asked
    to; a folder holding other files (a Hub clone's .git) is fine."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--hf {out} is a file, not a folder")
    held = [n for n in (ckpt.CONFIG_FILE, ckpt.MODEL_FILE) if (out / n).exists()]
    if held and not overwrite:
        raise CheckpointError(
            f"--hf {out} already holds a model ({held[0]}); pass --overwrite to replace it, or "
            "choose another folder"
        )


def export_run(run_dir: Path, out: Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Write the Hub layout of the run folder `run_dir` (all of its blocks, or a reference)
    into `out`; returns the facts the card shows."""
    run_dir = Path(run_dir)
    check_hf_dir_free(Path(out), overwrite=overwrite)
    if Path(out).resolve() == run_dir.resolve():
        raise CheckpointError("--hf must be another folder than the run folder")
    info, model = ckpt.load_model(run_dir)
    if isinstance(model, BlockStack) and not model.has_all_blocks():
        raise CheckpointError(
            f"{run_dir} holds only block(s) {model.block_ids} of {info.config.model.blocks}; "
            "an export needs the assembled model (train every block, or export the aggregator "
            "with --state)"
        )
    facts = run_facts(run_dir)
    write_hf(Path(out), info, model_tensors(model), facts, read_record(run_dir))
    return facts


def write_hf(
    out: Path,
    info: ckpt.RunInfo,
    tensors: Tensors,
    facts: dict[str, Any],
    record: dict[str, Any] | None,
) -> None:
    """The Hub folder: weights first, the card and data.json, config.json last (a folder
    without it is no model, so an export cut short is never read as one)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ckpt.CONFIG_FILE).unlink(missing_ok=True)
    step = facts.get("step")
    meta = {"format": ckpt.FORMAT, "kind": info.kind, "step": str(step if step is not None else 0)}
    ckpt.atomic_save_tensors(out / ckpt.MODEL_FILE, tensors, meta)
    atomic_write_bytes(out / CARD_FILE, model_card(out.name, info, facts, record).encode())
    if record is not None:
        atomic_write_bytes(out / DATA_FILE, (json.dumps(record, indent=2) + "\n").encode())
    else:
        (out / DATA_FILE).unlink(missing_ok=True)
    atomic_write_bytes(
        out / ckpt.CONFIG_FILE, (json.dumps(hf_config(info, step), indent=2) + "\n").encode()
    )


def hf_config(info: ckpt.RunInfo, step: int | None) -> dict[str, Any]:
    """config.json: the run's config (what `read_config` reads) and the Hub's keys."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURES[info.kind]],
        "blocktrain_version": blocktrain_version(),
        "vocab_size": 256,
        "torch_dtype": "float32",
        "step": step,
        **ckpt.config_doc(info),
    }


def load_hf(path: str | Path, device: torch.device | str = "cpu") -> tuple[ckpt.RunInfo, Model]:
    """An export's model, in eval mode, and what its config says; a CheckpointError (one line)
    for a folder that is not a BlockTrain export."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a folder (an export is a folder of config.json, model.safetensors "
            "and README.md)"
        )
    config = path / ckpt.CONFIG_FILE
    if not config.is_file():
        raise CheckpointError(
            f"{path} is not a Hugging Face export: it holds no {ckpt.CONFIG_FILE}"
        )
    try:
        doc = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config} is corrupt ({exc})") from exc
    model_type = doc.get("model_type") if isinstance(doc, dict) else None
    if model_type != MODEL_TYPE:
        if isinstance(doc, dict) and model_type is None and doc.get("format") == ckpt.FORMAT:
            raise CheckpointError(
                f"{path} is a BlockTrain run folder, not an export: read it with "
                f"blocktrain.load_model, or export it with `blocktrain export --run {path} "
                "--hf DIR`"
            )
        raise CheckpointError(
            f"{path} holds a model of model_type {model_type!r}, not a BlockTrain export "
            f"(model_type {MODEL_TYPE!r})"
        )
    if not (path / ckpt.MODEL_FILE).is_file():
        pickled = [n for n in PICKLED if (path / n).exists()]
        if pickled:
            raise CheckpointError(
                f"{path} holds pickled weights ({pickled[0]}), which blocktrain never loads; "
                f"it reads {ckpt.MODEL_FILE} only"
            )
        raise CheckpointError(f"{path} holds no {ckpt.MODEL_FILE}")
    info, model = ckpt.load_model(path, device)
    if isinstance(model, BlockStack) and not model.has_all_blocks():
        raise CheckpointError(
            f"{path} holds only block(s) {model.block_ids} of {info.config.model.blocks}"
        )
    return info, model


def from_pretrained(path: str | Path, device: torch.device | str = "cpu") -> Model:
    """The model of a Hugging Face export (`blocktrain export --hf DIR`), in eval mode: a
    BlockStack that `blocktrain.generate` samples from, or the autoregressive Reference."""
    return load_hf(path, device)[1]
