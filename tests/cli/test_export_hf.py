"""`blocktrain export --hf`: the Hugging Face Hub layout, read back by `from_pretrained`, eval
and generate, with the training table the run measured; one clear line for a bad folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import blocktrain
from blocktrain.cli.main import main
from blocktrain.errors import CheckpointError
from blocktrain.model import BlockStack
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.checkpoint import iter_metrics
from blocktrain.training.hub import load_hf
from tests.conftest import micro_config

from .test_cli import TINY, fails_cleanly


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _rows(card: str) -> dict[str, str]:
    return {
        cells[1].strip(): cells[2].strip()
        for line in card.splitlines()
        if line.startswith("| ") and len(cells := line.split("|")) == 4
    }


def _generate(capsys, folder: Path) -> str:
    argv = ["generate", str(folder), "--prompt", "The ", "--bytes", "24", "--seed", "5"]
    assert main(argv) == 0
    return capsys.readouterr().out


def test_export_run_loads_back_with_the_same_weights_and_bytes(trained, corpus, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export", "--run", str(trained), "--hf", str(hf)]) == 0
    assert "Hugging Face layout" in capsys.readouterr().out
    assert sorted(p.name for p in hf.iterdir()) == [
        "README.md",
        "config.json",
        "data.json",
        "model.safetensors",
    ]
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "blocktrain"
    assert config["architectures"] == ["BlockTrainBlockStack"]
    assert config["blocktrain_version"] == blocktrain.__version__
    assert config["model"] == json.loads((trained / "config.json").read_text())["model"]

    ours, _ = ckpt.load_tensors(trained / "model.safetensors")
    theirs, _ = ckpt.load_tensors(hf / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    model = blocktrain.from_pretrained(hf)
    assert isinstance(model, BlockStack) and model.has_all_blocks() and not model.training
    loaded = {
        f"block.{b}.{k}": v for b in model.block_ids for k, v in model.block(b).state_dict().items()
    }
    assert all(torch.equal(loaded[k], ours[k]) for k in loaded)

    assert _generate(capsys, hf) == _generate(capsys, trained)
    assert (
        main(["eval", str(hf), "--data", str(corpus), "--bytes", "64", "--sweeps", "1", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["data"]["same_as_training"] is True  # data.json travelled with the export

    card = (hf / "README.md").read_text()
    front = _front_matter(card)
    assert front["library_name"] == "blocktrain" and "blocktrain" in front["tags"]
    assert "datasets" not in front  # a local corpus is no Hub dataset
    rows = _rows(card)
    (last_eval,) = [r for r in iter_metrics(trained) if r["event"] == "eval"]
    assert rows["steps"] == "2 updates per block"
    assert rows["validation sampler CE"] == f"{last_eval['sampler_ce']:.4f} nats/byte"
    assert rows["test CE"].startswith("not measured")
    assert str(corpus.resolve()) in card  # the provenance of data.json


def test_export_refuses_bad_input_in_one_line(trained, corpus, tmp_path, capsys):
    hf = tmp_path / "hf"
    fails_cleanly(capsys, ["export", "--run", str(trained)], "give --out RUN_DIR")
    fails_cleanly(
        capsys, ["export", "--run", str(trained), "--out", str(tmp_path / "o")], "give --hf"
    )
    fails_cleanly(
        capsys, ["export", "--run", str(tmp_path / "none"), "--hf", str(hf)], "does not exist"
    )
    assert not hf.exists()
    assert main(["export", "--run", str(trained), "--hf", str(hf)]) == 0
    fails_cleanly(
        capsys, ["export", "--run", str(trained), "--hf", str(hf)], "already holds a model"
    )
    assert main(["export", "--run", str(trained), "--hf", str(hf), "--overwrite"]) == 0
    one = tmp_path / "one"
    assert (
        main(
            [
                "train",
                "--block",
                "0",  # block 0: under route = features a later block needs --upstream
                "--steps",
                "1",
                "--out",
                str(one),
                *TINY,
                "--data",
                str(corpus),
            ]
        )
        == 0
    )
    capsys.readouterr()
    fails_cleanly(
        capsys, ["export", "--run", str(one), "--hf", str(tmp_path / "h1")], "assembled model"
    )


def test_loading_refuses_folders_that_are_not_exports(trained, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="not a folder"):
        load_hf(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"holds no config\.json"):
        load_hf(empty)
    with pytest.raises(CheckpointError, match="export --run"):
        load_hf(trained)  # a run folder: load_model reads it, an export it is not
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2'"):
        load_hf(gpt2)
    fails_cleanly(capsys, ["generate", str(gpt2), "--prompt", "a"], "model_type 'gpt2'")
    fails_cleanly(capsys, ["eval", str(gpt2)], "model_type 'gpt2'")
    hf = tmp_path / "hf"
    assert main(["export", "--run", str(trained), "--hf", str(hf)]) == 0
    (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickled weights \(pytorch_model.bin\)"):
        load_hf(hf)
    (hf / "pytorch_model.bin").write_bytes(b"not safetensors")
    (hf / "pytorch_model.bin").rename(hf / "model.safetensors")
    fails_cleanly(capsys, ["generate", str(hf), "--prompt", "a"], "not a readable safetensors")


def test_export_state_to_the_hub_layout_says_what_it_did_not_measure(tmp_path, capsys):
    from tests.protocol.conftest import run_state

    state = tmp_path / "s"
    run_state(state, micro_config(), {}).close()
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["export", "--state", str(state), "--out", str(run), "--hf", str(hf)]) == 0
    assert "Hugging Face layout" in capsys.readouterr().out
    ours, _ = ckpt.load_tensors(run / "model.safetensors")
    theirs, _ = ckpt.load_tensors(hf / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    rows = _rows((hf / "README.md").read_text())
    assert rows["steps"] == "0 local steps per replica"
    for row in ("training bytes seen", "last training loss", "validation CE"):
        assert rows[row] == "not measured", row
    assert "Not recorded" in (hf / "README.md").read_text()
    assert not (hf / "data.json").exists()


def test_a_cluster_model_takes_its_summary_final_eval(tmp_path, capsys):
    """The model folder a cluster run writes has no metrics of its own: its summary.json's
    final evaluation fills the table."""
    from tests.protocol.conftest import run_state

    state = tmp_path / "cluster" / "state"
    run_state(state, micro_config(), {}).close()
    model = tmp_path / "cluster" / "model"
    assert main(["export", "--state", str(state), "--out", str(model)]) == 0
    summary = {
        "rounds": 4,
        "wall_seconds": 12.5,
        "model": str(model),
        "final": {"sampler_ce": 2.3456, "from_noise_ce": 2.5, "sweeps": 8, "bytes": 4096},
    }
    (tmp_path / "cluster" / "summary.json").write_text(json.dumps(summary))
    hf = tmp_path / "hf"
    assert main(["export", "--run", str(model), "--hf", str(hf)]) == 0
    rows = _rows((hf / "README.md").read_text())
    assert rows["validation sampler CE"] == "2.3456 nats/byte"
    assert rows["validation measured at"] == "step 0, 4,096 bytes, M = 8 sweeps"
    assert rows["rounds"] == "4" and rows["wall time"] == "12 s"
