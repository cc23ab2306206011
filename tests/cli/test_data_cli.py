"""Corpora on the command line: `blocktrain data --help` states the rules, `data info` shows
what a folder reads and skips, and --glob patterns reach every command that reads data,
the run's data.json and the processes `cluster` starts."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from blocktrain.cli.main import main
from blocktrain.protocol.ops import cluster
from tests.cli.test_cli import TINY, fails_cleanly

TEXT = b"It was the best of times, it was the worst of times.\n" * 30


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for rel, data in {
        "src/a.py": b"x = 1\n" * 80,
        "src/b.py": b"y = 2\n" * 80,
        "notes.txt.gz": gzip.compress(TEXT),
        "build/gen.py": b"z = 3\n" * 80,
        "build/lib.so": b"\x7fELF\x00" * 50,
        "img.png": b"\x89PNG\x00" * 50,
        "old.txt": "Señor Müller\n".encode("latin-1") * 40,
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_data_help_states_the_corpus_rules(capsys):
    with pytest.raises(SystemExit):
        main(["data", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for promise in (
        "wiki.train.raw, wiki.valid.raw, wiki.test.raw",
        "train is the first 90% of its bytes, valid the next 5%, test the last 5%",
        "subfolders included",
        "--glob GLOB reads only the files that match, --glob '!GLOB' none that match",
        "Hidden files and folders",
        "as its bytes",
        "gzip text (.gz)",
        "skipped in a folder, all of them summed up in one warning line",
        "blocktrain data info ~/src/project --glob '*.py'",
    ):
        assert promise in text, promise


def test_data_info_shows_what_a_folder_reads_and_skips(capsys, caplog, tree):
    caplog.set_level(logging.WARNING, logger="blocktrain.data.corpus")
    assert main(["data", "info", str(tree)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "folder" and "90%" in info["split_rule"]
    files = [Path(f).relative_to(tree).as_posix() for f in info["splits"]["train"]["files"]]
    assert files == ["build/gen.py", "notes.txt.gz", "old.txt", "src/a.py", "src/b.py"]
    assert info["skipped"] == {"not text": 2} and info["skipped_first"] == [
        "build/lib.so",
        "img.png",
    ]
    assert info["not_utf8"] == ["old.txt"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].endswith(
        "skipped 2 files: 2 not text (first: build/lib.so, img.png)"
    )
    assert main(["data", "info", str(tree), "--glob", "*.py", "--glob", "!build/**"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [Path(f).name for f in info["splits"]["valid"]["files"]] == ["a.py", "b.py"]
    assert info["include"] == ["*.py"] and info["exclude"] == ["build/**"]
    assert info["excluded"] == 5 and info["skipped"] == {}


def test_bad_patterns_are_one_line_and_exit_2(capsys, tmp_path, tree):
    file = tmp_path / "one.txt"
    file.write_bytes(TEXT)
    out = tmp_path / "r"
    fails_cleanly(
        capsys,
        ["train", "--data", str(file), "--glob", "*.md", "--out", str(out), *TINY],
        "choose files of a folder",
    )
    fails_cleanly(
        capsys,
        ["train", "--data", str(tree), "--glob", "*.rs", "--out", str(out), *TINY],
        "is chosen by --glob '*.rs'",
    )
    fails_cleanly(capsys, ["data", "info", str(tree), "--glob", ""], "non-empty glob")
    assert not out.exists()


def test_a_run_remembers_its_patterns_and_eval_names_them(capsys, tmp_path, tree):
    run = tmp_path / "run"
    patterns = ["--glob", "*.py", "--glob", "!build/**"]
    argv = ["train", "--data", str(tree), *patterns, "--out", str(run), "--steps", "1", *TINY]
    assert main(argv) == 0
    record = json.loads((run / "data.json").read_text())
    assert record["include"] == ["*.py"] and record["exclude"] == ["build/**"]
    assert [Path(f).name for f in record["splits"]["train"]["files"]] == ["a.py", "b.py"]
    capsys.readouterr()
    evaluate = ["eval", str(run), "--data", str(tree), "--bytes", "16", "--sweeps", "1", "--json"]
    assert main([*evaluate, *patterns]) == 0
    same = capsys.readouterr()
    assert json.loads(same.out)["data"]["same_as_training"] is True and "warning" not in same.err
    assert main(evaluate) == 0
    other = capsys.readouterr()
    assert json.loads(other.out)["data"]["same_as_training"] is False
    assert "it was trained with --glob '*.py' --glob '!build/**'" in other.err


def test_cluster_passes_the_patterns_to_its_aggregator_and_workers(monkeypatch, tmp_path):
    started: list[list[str]] = []

    def fake_spawn(name, argv, logs, **_):
        started.append(list(argv))
        raise RuntimeError("stop here")

    monkeypatch.setattr(cluster, "spawn", fake_spawn)
    with pytest.raises(RuntimeError):
        cluster.start_worker(
            "http://127.0.0.1:1",
            "token",
            tmp_path,
            name="w",
            data="/corpus",
            data_patterns=["--glob", "*.txt", "--glob", "!build/**"],
        )
    argv = started[0]
    i = argv.index("--data")
    assert argv[i : i + 6] == ["--data", "/corpus", "--glob", "*.txt", "--glob", "!build/**"]


def test_the_readme_states_the_rules_the_code_follows():
    from blocktrain.data.corpus import SPLIT_FRACTIONS, WIKITEXT_FILES
    from blocktrain.data.sniff import gzip_cap

    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    section = readme.split("## Your own corpus", 1)[1].split("## ", 1)[0]
    train, valid = (round(100 * f) for f in SPLIT_FRACTIONS)
    assert f"train is its first {train}%, valid the next {valid - train}%" in section
    assert all(f"`{name}`" in section for name in WIKITEXT_FILES.values())
    assert f"at most {gzip_cap()} of their text per corpus" in section
    assert "--glob GLOB" in section and "Hidden files and folders are never read" in section
