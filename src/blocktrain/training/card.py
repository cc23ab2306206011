"""The model card of a Hugging Face export (its README.md) and the facts it shows. A figure the
source does not hold is "not measured" on the card, never guessed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from blocktrain.config import RunConfig
from blocktrain.data.provenance import DATA_FILE
from blocktrain.errors import CheckpointError
from blocktrain.training import checkpoint as ckpt


def blocktrain_version() -> str:
    """The package's version, for the card and config.json (imported late: the package's
    __init__ imports training)."""
    from blocktrain import __version__

    return __version__


def run_facts(run_dir: Path) -> dict[str, Any]:
    """What a run folder (state.json, metrics.jsonl) or a `cluster` run's summary.json says about
    its training, for the model card; a value the run does not hold is None."""
    from blocktrain.training.checkpoint import iter_metrics

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
        ["autoregressive"] if reference else ["diffusion", "gaussian-noise"]
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
            f"{m.seq_len} bytes, spans of K = {m.span} byte{'s' * (m.span != 1)}, gaussian noise, route "
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
        f"Exported by blocktrain {blocktrain_version()} from {facts['source']}.",
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
