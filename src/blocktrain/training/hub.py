"""The Hugging Face Hub layout of a trained model: what `blocktrain export --hf DIR` writes, and
what `blocktrain.from_pretrained(DIR)` (or `load_hf`) reads back.

    DIR/config.json        the run's config.json (format, kind, blocks, preset, seed, model,
                           train) plus the Hub's keys: model_type "blocktrain", architectures,
                           blocktrain_version, vocab_size, torch_dtype, and the step exported
    DIR/model.safetensors  the weights, named as in a run folder ("block.{b}.*" and "targets",
                           or "reference.*"); safetensors only, nothing is ever pickled
    DIR/README.md          the model card: YAML front matter (library_name: blocktrain, tags,
                           pipeline_tag, datasets when the corpus was a Hub dataset), how to
                           load it, the training table (steps, losses, validation CE, or "not
                           measured"), the training data and the config
    DIR/data.json          the run's corpus record, when it has one: `blocktrain eval DIR`
                           compares the data it is given with it, as for a run folder

The config.json is a run folder's with keys added, so `load_model`, `blocktrain eval DIR`,
`generate DIR` and `serve-block DIR` read an export as they read a run. Other files of DIR (a
clone's .git, .gitattributes) are left as they are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import RunConfig
from blocktrain.data.provenance import DATA_FILE, read_record
from blocktrain.errors import CheckpointError
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.model import BlockStack, Reference
from blocktrain.training import checkpoint as ckpt

MODEL_TYPE = "blocktrain"
ARCHITECTURES = {"blocktrain": "BlockTrainBlockStack", "reference": "BlockTrainReference"}
CARD_FILE = "README.md"
PICKLED = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.bin.index.json")
"""Weights files of other libraries that unpickle: named in the refusal, never opened."""

Tensors = dict[str, torch.Tensor]
Model = BlockStack | Reference


def _version() -> str:
    from blocktrain import __version__

    return __version__


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


def run_facts(run_dir: Path) -> dict[str, Any]:
    """What a run folder says about its training, for the model card: the step, bytes seen,
    wall time (state.json), the last training loss and the last validation (metrics.jsonl), or,
    for the model folder a `cluster` run writes, its summary.json's final evaluation. A value
    the run does not hold is None ("not measured" on the card)."""
    from blocktrain.training.trainer import iter_metrics

    run_dir = Path(run_dir)
    facts: dict[str, Any] = {
        "source": f"the run folder {run_dir.name}",
        "step": None,
        "step_unit": "updates per block",
        "planned_steps": None,
        "bytes_seen": None,
        "wall_seconds": None,
        "train_loss": None,
        "valid": None,
    }
    info = ckpt.read_config(run_dir)
    facts["planned_steps"] = info.config.train.steps
    facts["blocks"] = len(info.blocks)
    if info.kind == "reference":
        facts["step_unit"] = "updates"
    try:
        state = ckpt.read_state(run_dir)
    except CheckpointError:
        state = None
    if state is not None:
        facts["step"] = state["step"]
        facts["bytes_seen"] = state.get("bytes_seen")
        facts["wall_seconds"] = state.get("wall_seconds")
    else:
        _, meta = ckpt.load_tensors(run_dir / ckpt.MODEL_FILE)
        if str(meta.get("step", "")).isdigit():
            facts["step"] = int(meta["step"])
    try:
        records = list(iter_metrics(run_dir))
    except (OSError, ValueError):
        records = []
    trains = [r for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval" and r.get("split") == "valid"]
    if trains and _number(trains[-1].get("loss")):
        facts["train_loss"] = {"value": trains[-1]["loss"], "step": trains[-1].get("step")}
    if evals:
        last = evals[-1]
        facts["valid"] = {
            **{k: v for k, v in last.items() if k in CE_ROWS and _number(v)},
            "step": last.get("step"),
            "bytes": last.get("bytes"),
            "sweeps": last.get("sweeps"),
        }
    summary = _cluster_summary(run_dir)
    if summary is not None:
        final = summary.get("final") or {}
        facts["source"] = f"the cluster run {run_dir.parent.name} (summary.json)"
        facts["step_unit"] = "local steps per replica"
        rounds = summary.get("rounds")
        if isinstance(rounds, int):
            facts["rounds"] = rounds
        facts["wall_seconds"] = facts["wall_seconds"] or summary.get("wall_seconds")
        if any(_number(final.get(k)) for k in CE_ROWS):
            facts["valid"] = {
                **{k: v for k, v in final.items() if k in CE_ROWS and _number(v)},
                "step": facts["step"],
                "bytes": final.get("bytes"),
                "sweeps": final.get("sweeps"),
            }
    return facts


def _cluster_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary.json of the cluster run whose model folder `run_dir` is, or None."""
    path = run_dir.parent / "summary.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not doc.get("model"):
        return None
    try:
        same = Path(str(doc["model"])).resolve() == run_dir.resolve()
    except OSError:
        return None
    return doc if same else None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


CE_ROWS = {
    "sampler_ce": "validation sampler CE",
    "joint_ce": "validation joint CE (whole spans)",
    "from_noise_ce": "validation from-noise CE (one sweep)",
    "oracle_ce": "validation oracle CE",
    "ce": "validation CE",
}
"""The evaluation figures the card's table shows, when the run measured them (nats/byte)."""


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


def state_facts(state_dir: Path, step: int, versions: dict[int, int]) -> dict[str, Any]:
    """The card's facts for blocks assembled from an aggregator state: its versions and steps;
    the aggregator's state holds no evaluation, so the CE rows say "not measured"."""
    shown = ", ".join(f"b{b}=v{v}" for b, v in versions.items())
    return {
        "source": f"the aggregator state {Path(state_dir).name} (versions {shown})",
        "step": step,
        "step_unit": "local steps per replica",
        "planned_steps": None,
        "bytes_seen": None,
        "wall_seconds": None,
        "train_loss": None,
        "valid": None,
    }


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
        "blocktrain_version": _version(),
        "vocab_size": 256,
        "torch_dtype": "float32",
        "step": step,
        "format": ckpt.FORMAT,
        "format_version": ckpt.FORMAT_VERSION,
        "kind": info.kind,
        "blocks": info.blocks,
        **info.config.to_dict(),
    }


def _yaml_list(key: str, items: list[str]) -> list[str]:
    # JSON strings are YAML double-quoted scalars: no escaping rules of our own
    return [f"{key}:", *(f"- {json.dumps(i)}" for i in items)] if items else []


def hub_datasets(record: dict[str, Any] | None) -> list[str]:
    """The Hub dataset ids a corpus record names (a `hf:NAME` corpus); none for local data."""
    ds = (record or {}).get("dataset")
    if isinstance(ds, dict) and ds.get("hub") and isinstance(ds.get("name"), str):
        return [ds["name"]]
    return []


def model_card(
    name: str, info: ckpt.RunInfo, facts: dict[str, Any], record: dict[str, Any] | None
) -> str:
    """README.md: YAML front matter for the Hub, then what the model is, how to load it, how it
    was trained (every figure the run measured, "not measured" for the others) and on what."""
    cfg: RunConfig = info.config
    m = cfg.model
    reference = info.kind == "reference"
    tags = ["blocktrain", "byte-level"] + (
        ["autoregressive"] if reference else ["diffusion", f"{m.process}-noise"]
    )
    front = [
        "---",
        "library_name: blocktrain",
        "pipeline_tag: text-generation",
        *_yaml_list("tags", tags),
        *_yaml_list("datasets", hub_datasets(record)),
        "---",
        "",
    ]
    if reference:
        what = (
            f"An end-to-end autoregressive byte-level reference of {m.layers} layers "
            f"(d_model = {m.d_model}, {m.n_heads} heads, context {m.seq_len} bytes), trained "
            "with [BlockTrain](https://arxiv.org/abs/2606.24722)."
        )
    else:
        what = (
            f"A byte-level language model of {m.blocks} independently trained diffusion blocks "
            f"({m.layers} layers in all, d_model = {m.d_model}, {m.n_heads} heads, context "
            f"{m.seq_len} bytes, spans of K = {m.span} byte{'s' * (m.span != 1)}, {m.process} noise, route "
            f"{m.route}), trained with [BlockTrain](https://arxiv.org/abs/2606.24722). Its "
            "vocabulary is the 256 byte values."
        )
    body = [
        f"# {name}",
        "",
        what,
        "",
        "## Use",
        "",
        "```python",
        "import blocktrain",
        "",
        f'model = blocktrain.from_pretrained("{name}")  # a folder: download it first',
        "```",
        "",
        "```sh",
        f'blocktrain generate {name} --prompt "The " --bytes 200',
        f"blocktrain eval {name} --data CORPUS --split test",
        "```",
        "",
        f"Exported by blocktrain {_version()} from {facts['source']}.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        *_training_rows(facts),
        "",
        "CE is cross-entropy in nats per byte, on the validation split of the training data "
        "(`blocktrain eval` measures it, and the test split, again).",
        "",
        "## Training data",
        "",
        *_data_lines(record),
        "",
        "## Config",
        "",
        "```json",
        json.dumps(cfg.to_dict(), indent=2, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(front + body)


NOT_MEASURED = "not measured"


def _training_rows(facts: dict[str, Any]) -> list[str]:
    rows: list[tuple[str, str]] = []
    step = facts.get("step")
    planned = facts.get("planned_steps")
    if step is None:
        rows.append(("steps", NOT_MEASURED))
    else:
        of = f" of {planned}" if planned is not None and planned != step else ""
        rows.append(("steps", f"{step}{of} {facts['step_unit']}"))
    if "rounds" in facts:
        rows.append(("rounds", str(facts["rounds"])))
    seen = facts.get("bytes_seen")
    rows.append(("training bytes seen", f"{seen:,}" if _number(seen) else NOT_MEASURED))
    wall = facts.get("wall_seconds")
    rows.append(("wall time", f"{wall:.0f} s" if _number(wall) else NOT_MEASURED))
    loss = facts.get("train_loss")
    loss_of = "; the mean of the blocks' block-local losses" if facts.get("blocks", 1) > 1 else ""
    rows.append(
        (
            "last training loss",
            f"{loss['value']:.4f} (step {loss['step']}{loss_of})" if loss else NOT_MEASURED,
        )
    )
    valid = facts.get("valid") or {}
    shown = [k for k in CE_ROWS if k in valid]
    if "joint_ce" in shown and "sampler_ce" in shown and valid["joint_ce"] == valid["sampler_ce"]:
        shown.remove("joint_ce")  # K = 1: the same figure
    for key in shown:
        rows.append((CE_ROWS[key], f"{valid[key]:.4f} nats/byte"))
    if shown:
        how = [f"step {valid['step']}"] if valid.get("step") is not None else []
        if valid.get("bytes"):
            how.append(f"{valid['bytes']:,} bytes")
        if valid.get("sweeps"):
            how.append(f"M = {valid['sweeps']} sweeps")
        rows.append(("validation measured at", ", ".join(how) or NOT_MEASURED))
    else:
        rows.append(("validation CE", NOT_MEASURED))
    rows.append(("test CE", f"{NOT_MEASURED} (`blocktrain eval DIR --split test`)"))
    return [f"| {k} | {v} |" for k, v in rows]


def _data_lines(record: dict[str, Any] | None) -> list[str]:
    if record is None:
        return [f"Not recorded: the run holds no {DATA_FILE}."]
    lines = [f"- corpus: `{record.get('path')}` ({record.get('layout')})"]
    ds = record.get("dataset")
    if isinstance(ds, dict):
        lines.append(
            f"- Hugging Face dataset: `{ds.get('name')}`"
            + (f", config `{ds['config']}`" if ds.get("config") else "")
            + f", text field `{ds.get('text_field')}`"
        )
    lines.append(f"- split rule: {record.get('split_rule')}")
    if record.get("include") or record.get("exclude"):
        lines.append(
            f"- files: include {record.get('include') or 'all'}, exclude "
            f"{record.get('exclude') or 'none'}"
        )
    for split, s in (record.get("splits") or {}).items():
        lines.append(f"- {split}: {s.get('bytes'):,} bytes, sha256 `{s.get('sha256')}`")
    lines.append(f"\n`{DATA_FILE}` beside this card holds the same record.")
    return lines


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
