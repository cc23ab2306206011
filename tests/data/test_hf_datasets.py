"""Hugging Face `datasets` as a corpus (`--data hf:...`): datasets the tests build and save
themselves, read offline; their splits, the 90/5/5 rule for one split, provenance in data.json,
and one clear line for every bad input."""

from __future__ import annotations

import json
import os
import sys

import pytest

# before `datasets` is imported: no test may reach the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets

from blocktrain.cli.main import main
from blocktrain.data import ByteCorpus, load_split
from blocktrain.errors import DataError
from blocktrain.training.card import hub_datasets
from tests.cli.test_cli import TINY, fails_cleanly
from tests.conftest import TEXT

datasets.disable_progress_bars()  # the tests read stderr line by line

ROWS = [TEXT[i : i + 50] for i in range(0, len(TEXT), 50)] * 12


def joined(rows: list[str]) -> bytes:
    """What the corpus reads: each record, a newline after one that lacks it."""
    return b"".join(r.encode() + (b"" if r.endswith("\n") else b"\n") for r in rows if r)


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """The text cache and the datasets cache in the test's folder, and no network."""
    monkeypatch.setenv("BLOCKTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


@pytest.fixture
def splits_dataset(tmp_path):
    """A DatasetDict saved by save_to_disk, with train, validation and test."""
    path = tmp_path / "dsd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ROWS}),
            "validation": datasets.Dataset.from_dict({"text": [*ROWS[:20], "", "tail"]}),
            "test": datasets.Dataset.from_dict({"text": ROWS[20:40]}),
        }
    ).save_to_disk(path)
    return path


@pytest.fixture
def one_split(tmp_path):
    """A plain Dataset whose text is in column `content`, beside a number column."""
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"content": ROWS, "n": list(range(len(ROWS)))}).save_to_disk(path)
    return path


def test_a_dataset_with_splits_gives_its_own(splits_dataset):
    corpus = ByteCorpus.open(f"hf:{splits_dataset}")
    assert corpus.layout == "hf" and corpus.source == f"hf:{splits_dataset}"
    assert corpus.split("train").read().tobytes() == joined(ROWS)
    assert corpus.split("valid").read().tobytes() == joined([*ROWS[:20], "", "tail"])
    assert corpus.split("test").read().tobytes() == joined(ROWS[20:40])
    assert corpus.dataset is not None
    assert corpus.dataset["splits"] == {"train": "train", "valid": "validation", "test": "test"}


def test_one_split_is_cut_90_5_5_by_position(one_split):
    corpus = ByteCorpus.open(f"hf:{one_split}#content")
    text = joined(ROWS)
    train, valid, test = (corpus.split(s).read().tobytes() for s in ("train", "valid", "test"))
    assert train + valid + test == text
    assert len(train) == int(0.9 * len(text)) and len(train + valid) == int(0.95 * len(text))


def test_the_text_is_cached_once_per_fingerprint_and_field(one_split, tmp_path):
    first = load_split(f"hf:{one_split}#content", "train").paths[0]
    mtime = first.stat().st_mtime_ns
    again = load_split(f"hf:{one_split}#content", "train").paths[0]
    assert again == first and again.stat().st_mtime_ns == mtime, "read from the cache"
    assert first.is_relative_to(tmp_path / "cache" / "hf")
    datasets.Dataset.from_dict({"content": ROWS[:30]}).save_to_disk(tmp_path / "other")
    other = load_split(f"hf:{tmp_path / 'other'}#content", "train").paths[0]
    assert other.parent != first.parent, "another dataset, another fingerprint"


def test_load_dataset_reads_a_local_folder_of_data_files(tmp_path):
    folder = tmp_path / "jsonl"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in ROWS))
    (folder / "test.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in ROWS[:9]))
    corpus = ByteCorpus.open(f"hf:{folder}")
    assert corpus.split("train").read().tobytes() == joined(ROWS)
    assert corpus.split("test").read().tobytes() == joined(ROWS[:9])
    with pytest.raises(DataError, match="no validation or valid or dev split"):
        corpus.split("valid")


def test_train_records_the_dataset_and_eval_checks_it(one_split, splits_dataset, tmp_path, capsys):
    run = tmp_path / "run"
    data = ["--data", f"hf:{one_split}#content"]
    assert main(["train", *data, "--out", str(run), "--steps", "1", *TINY]) == 0
    capsys.readouterr()
    record = json.loads((run / "data.json").read_text())
    assert record["path"] == f"hf:{one_split}#content" and record["layout"] == "hf"
    ds = record["dataset"]
    assert ds["text_field"] == "content" and ds["hub"] is False
    assert ds["name"] == str(one_split.resolve()) and ds["fingerprints"]["all"]
    assert "one split" in record["split_rule"]
    evaluate = ["eval", str(run), "--bytes", "32", "--sweeps", "1", "--json"]
    assert main([*evaluate, *data]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["same_as_training"] is True
    assert main([*evaluate, "--data", f"hf:{splits_dataset}"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["data"]["same_as_training"] is False
    assert "was trained on other data" in out.err
    hf = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--hf", str(hf)]) == 0
    card = (hf / "README.md").read_text()
    assert (
        f"Hugging Face dataset: `{one_split.resolve()}`" in card and "text field `content`" in card
    )


def test_a_hub_dataset_is_named_in_the_model_card_front_matter():
    hub = {"dataset": {"name": "Salesforce/wikitext", "hub": True}}
    assert hub_datasets(hub) == ["Salesforce/wikitext"]
    assert hub_datasets({"dataset": {"name": "/data/x", "hub": False}}) == []
    assert hub_datasets(None) == []


def test_bad_datasets_are_refused_in_one_line(one_split, splits_dataset, tmp_path, capsys):
    info = ["data", "info"]
    fails_cleanly(capsys, [*info, f"hf:{one_split}"], "no column 'text' (its columns: content, n)")
    fails_cleanly(capsys, [*info, f"hf:{one_split}#n"], "not text")
    fails_cleanly(capsys, [*info, str(one_split)], f"pass --data hf:{one_split}")
    fails_cleanly(
        capsys, [*info, f"hf:{splits_dataset}", "--glob", "*.txt"], "choose files of a folder"
    )
    fails_cleanly(capsys, [*info, f"hf:{tmp_path / 'none'}"], "does not exist")
    fails_cleanly(capsys, [*info, f"hf:{splits_dataset}:cfg"], "has no configs")
    fails_cleanly(capsys, [*info, "hf:someone/not-cached"], "cannot load the Hugging Face dataset")
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"text": ["", None]}).save_to_disk(empty)
    fails_cleanly(capsys, [*info, f"hf:{empty}"], "holds no text")
    many = tmp_path / "many"
    datasets.DatasetDict(
        {n: datasets.Dataset.from_dict({"text": ROWS}) for n in ("a", "b")}
    ).save_to_disk(many)
    fails_cleanly(capsys, [*info, f"hf:{many}"], "has splits a, b and no train split")
    run = tmp_path / "run"
    fails_cleanly(
        capsys, ["train", "--data", f"hf:{one_split}", "--out", str(run), *TINY], "no column"
    )
    assert not run.exists()


def test_without_the_datasets_package_one_line_names_pip(one_split, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    fails_cleanly(capsys, ["data", "info", f"hf:{one_split}"], "pip install datasets")
