"""The command line: examples in --help, and one clear line with exit code 2 for every bad
input, with nothing overwritten."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blocktrain.cli.main import main

TINY = [
    "--set",
    "d_model=32",
    "n_heads=2",
    "seq_len=16",
    "batch_size=4",
    "eval_bytes=64",
    "eval_sweeps=2",
    "log_every=1",
    "--no-progress",
]


def fails_cleanly(capsys, argv, match):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, f"{argv} exited {code}: {err}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("blocktrain: error:"), err
    assert "Traceback" not in err
    assert match in lines[0], lines[0]
    return lines[0]


def test_train_block_takes_the_one_blocks_rule(capsys, tmp_path):
    """train --block parses as every --blocks does: a negative index or a repeated one is
    refused, naming the text, before the data is opened or the run folder made."""
    for bad in ("-1", "0,0", "x"):
        argv = ["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r"), *TINY]
        fails_cleanly(capsys, [*argv, "--block", bad], f"--block {bad!r}: expected distinct")
    assert not (tmp_path / "r").exists()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_help_shows_examples(capsys):
    for cmd in ("train", "eval", "generate", "plan", "data"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        assert "examples:" in capsys.readouterr().out, cmd


def test_missing_data_path(capsys, tmp_path):
    fails_cleanly(
        capsys,
        ["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r"), *TINY],
        "does not exist",
    )
    assert not (tmp_path / "r").exists()


def test_no_data_given(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    fails_cleanly(capsys, ["train", "--out", str(tmp_path / "r"), *TINY], "no data given")


def test_empty_file(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    fails_cleanly(
        capsys, ["train", "--data", str(empty), "--out", str(tmp_path / "r"), *TINY], "empty"
    )


def test_binary_only_file(capsys, tmp_path):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    fails_cleanly(
        capsys,
        ["train", "--data", str(binary), "--out", str(tmp_path / "r"), *TINY],
        "does not look like text",
    )


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("span=5", "must divide seq_len"),
        ("sigma_min=0", "sigma_min"),
        ("sigma_min=-1", "sigma_min"),
        ("blocks=4", "cannot exceed layers"),
        ("no_such_key=1", "unknown --set key"),
        ("d_model=abc", "expected a int"),
    ],
)
def test_bad_settings_overwrite_nothing(capsys, trained, corpus, setting, match):
    before = snapshot(trained)
    fails_cleanly(
        capsys,
        [
            "train",
            "--data",
            str(corpus),
            "--out",
            str(trained),
            "--overwrite",
            *TINY,
            "--set",
            setting,
        ],
        match,
    )
    assert snapshot(trained) == before


def test_existing_run_needs_resume_or_overwrite(capsys, trained, corpus):
    before = snapshot(trained)
    fails_cleanly(
        capsys,
        ["train", "--data", str(corpus), "--out", str(trained), *TINY],
        "already holds a run",
    )
    assert snapshot(trained) == before


def test_corrupt_checkpoint(capsys, trained, corpus):
    (trained / "model.safetensors").write_bytes(b"garbage" * 10)
    fails_cleanly(capsys, ["eval", str(trained), "--data", str(corpus)], "safetensors")
    fails_cleanly(capsys, ["generate", str(trained), "--prompt", "a"], "safetensors")
    before = snapshot(trained)
    fails_cleanly(
        capsys,
        ["train", "--resume", "--out", str(trained), "--data", str(corpus), "--no-progress"],
        "safetensors",
    )
    assert snapshot(trained) == before


def test_foreign_checkpoint(capsys, tmp_path, corpus):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    fails_cleanly(capsys, ["eval", str(foreign), "--data", str(corpus)], "not a BlockTrain")
    fails_cleanly(
        capsys, ["eval", str(tmp_path / "missing"), "--data", str(corpus)], "does not exist"
    )


def test_bad_generation_settings(capsys, trained):
    fails_cleanly(capsys, ["generate", str(trained), "--prompt", ""], "at least one byte")
    fails_cleanly(capsys, ["generate", str(trained), "--prompt", "a", "--set", "top_p=0"], "top_p")
    fails_cleanly(capsys, ["generate", str(trained), "--prompt", "a", "--bytes", "0"], "--bytes")
    fails_cleanly(
        capsys, ["generate", str(trained), "--prompt", "a", "--sampler", "heun"], "unknown sampler"
    )
    fails_cleanly(
        capsys,
        ["generate", str(trained), "--prompt", "a", "--steps-per-block", "0"],
        "--steps-per-block",
    )


def test_generate_takes_the_sampler_and_its_steps(capsys, trained):
    args = [
        "generate",
        str(trained),
        "--prompt",
        "ab",
        "--bytes",
        "6",
        "--set",
        "continuation_only=1",
    ]
    outs = {}
    for sampler in ("euler", "ancestral"):
        assert main([*args, "--sampler", sampler, "--steps-per-block", "2"]) == 0
        outs[sampler] = capsys.readouterr().out
    assert all(outs.values()), outs


def test_eval_and_generate_run_on_the_threads_asked_for(capsys, trained, corpus, monkeypatch):
    """--threads N beside another job (the benches' evaluations); 0, the default, leaves
    torch's choice; a negative count is a usage error before anything is read."""
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    gen = ["generate", str(trained), "--prompt", "ab", "--bytes", "2"]
    assert main([*gen, "--threads", "1"]) == 0
    ev = ["eval", str(trained), "--data", str(corpus), "--bytes", "256", "--sweeps", "1"]
    assert main([*ev, "--threads", "2"]) == 0
    assert main(gen) == 0
    assert asked == [1, 2]
    capsys.readouterr()
    for argv in (gen, ev):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--threads", "-1"])
        assert exc.value.code == 2 and "not a thread count" in capsys.readouterr().err


def test_eval_with_a_judge_reports_the_judged_continuations(capsys, tmp_path, trained, corpus):
    judge = tmp_path / "judge"
    args = ["--data", str(corpus), "--steps", "2", "--reference", *TINY, "--set", "seq_len=32"]
    assert main(["train", "--out", str(judge), *args, "seed=1"]) == 0
    capsys.readouterr()
    base = ["eval", str(trained), "--data", str(corpus), "--bytes", "32", "--sweeps", "2"]
    small = ["--set", "prompts=2", "prompt_bytes=10", "continuation_bytes=6"]
    assert main([*base, "--judge", str(judge), *small, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    gen = out["generated"]
    assert {"gen_ce", "floor_ce", "entropy", "real_entropy", "samples"} <= set(gen)
    assert gen["prompts"] == 2 and gen["continuation_bytes"] == 6
    assert out["joint_ce"] > 0 and out["span"] == 1
    # temperature: the continuations' temperature (0: greedy, fewer distinct bytes)
    assert main([*base, "--judge", str(judge), *small, "temperature=0", "--json"]) == 0
    cold = json.loads(capsys.readouterr().out)["generated"]
    assert (gen["temperature"], cold["temperature"]) == (1.0, 0.0)
    assert cold["entropy"] < gen["entropy"]
    assert main([*base, "--judge", str(judge), *small]) == 0
    assert "judge CE" in capsys.readouterr().out
    fails_cleanly(capsys, [*base, "--judge", str(trained)], "is not a reference")
    fails_cleanly(
        capsys,
        [*base, "--judge", str(judge), "--set", "continuation_bytes=0"],
        "continuation_bytes",
    )
    fails_cleanly(capsys, [*base, "--set", "sampler=euler"], "give --sampler")


def test_one_block_run_cannot_be_evaluated_as_a_model(capsys, tmp_path, corpus):
    run = tmp_path / "b1"
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--out",
                str(run),
                "--steps",
                "1",
                "--block",
                "0",  # block 0: under route = features a later block needs --upstream
                *TINY,
            ]
        )
        == 0
    )
    capsys.readouterr()
    fails_cleanly(capsys, ["eval", str(run), "--data", str(corpus)], "assembled model")


def test_plan_paper_reports_memory(capsys):
    assert main(["plan", "--preset", "paper", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    per_block, total = plan["params_per_block"], plan["params_total"]
    assert len(per_block) == 3 and sum(per_block) == total
    assert plan["optimizer_state_bytes_worker"] == 8 * per_block[0]
    assert plan["optimizer_state_bytes_full"] == 8 * total
    assert [round(s, 4) for s in plan["sigma_boundaries"]] == [1.0, 1.3436, 2.0711, 10.0]
    assert plan["config"]["model"]["layers"] == 12 and plan["layers_per_block"] == 4


def test_train_eval_generate_end_to_end(tmp_path, corpus):
    """The installed console script, as a user runs it."""
    exe = Path(sys.executable).with_name("blocktrain")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "blocktrain.cli.main"]
    env = {**os.environ, "BLOCKTRAIN_DATA": str(corpus)}
    run = tmp_path / "e2e"

    def call(*args):
        return subprocess.run(
            [*cmd, *args], env=env, capture_output=True, text=True, timeout=120, check=True
        )

    call("train", "--out", str(run), "--steps", "3", *TINY)
    out = json.loads(call("eval", str(run), "--json", "--bytes", "64", "--sweeps", "2").stdout)
    assert {"sampler_ce", "from_noise_ce", "ce_per_step", "oracle_ce", "bits_per_byte"} <= set(out)
    assert len(out["ce_per_step"]) == 3
    text = call(
        "generate", str(run), "--prompt", "The ", "--bytes", "20", "--set", "continuation_only=1"
    ).stdout
    assert len(text.rstrip("\n").encode("utf-8", errors="surrogateescape")) >= 1
    ref = tmp_path / "ref"
    call("train", "--out", str(ref), "--steps", "2", "--reference", *TINY)
    out = json.loads(call("eval", str(ref), "--json", "--bytes", "64").stdout)
    assert {"ce", "bits_per_byte"} <= set(out)


def test_python_dash_m_blocktrain_is_the_command(tmp_path):
    """Issue 30 (a newcomer's walkthrough): `python -m blocktrain` said "No module named
    blocktrain.__main__"; it is the `blocktrain` command, exit codes included."""
    cmd = [sys.executable, "-m", "blocktrain"]
    done = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.split()[0]) == (0, "blocktrain"), done.stderr
    bad = [*cmd, "train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]
    done = subprocess.run(bad, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("blocktrain: error: "), done.stderr
    assert not (tmp_path / "r").exists()


def test_a_warning_reads_as_the_commands_own(tmp_path):
    """Issue 30 (tests/test_newcomer.py): the one line for skipped files read `WARNING
    blocktrain.data.corpus: ...`, a logger's name; it reads as the other warnings do."""
    (tmp_path / "notes.txt").write_text("some notes\n" * 50)
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    cmd = [sys.executable, "-m", "blocktrain", "data", "info", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        f"blocktrain: warning: {tmp_path}: skipped 1 file: 1 not text (first: logo.png)\n"
    )


def test_data_fetch_from_a_local_archive(capsys, tmp_path):
    import zipfile

    archive = tmp_path / "wikitext-2-raw-v1.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for split in ("train", "valid", "test"):
            zf.writestr(f"wikitext-2-raw/wiki.{split}.raw", f" = {split} = \n text \n" * 20)
    dest = tmp_path / "wt2"
    assert main(["data", "fetch", "wikitext-2", "--to", str(dest), "--url", archive.as_uri()]) == 0
    assert sorted(p.name for p in dest.iterdir()) == [
        "wiki.test.raw",
        "wiki.train.raw",
        "wiki.valid.raw",
    ]
    capsys.readouterr()
    assert main(["data", "info", str(dest)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "wikitext" and info["splits"]["train"]["bytes"] > 0
    fails_cleanly(
        capsys,
        [
            "data",
            "fetch",
            "wikitext-2",
            "--to",
            str(tmp_path / "x"),
            "--url",
            f"{archive.as_uri()}#sha256={'0' * 64}",
        ],
        "sha256",
    )
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()  # the fragment's own digest passes
    url = f"{archive.as_uri()}#sha256={digest}"
    assert main(["data", "fetch", "wikitext-2", "--to", str(tmp_path / "y"), "--url", url]) == 0


def no_gpu(monkeypatch):
    """This machine as one without CUDA, whatever it has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_a_missing_gpu_is_one_line_before_anything_is_written(
    capsys, monkeypatch, tmp_path, corpus
):
    no_gpu(monkeypatch)
    out = tmp_path / "r"
    base = ["train", "--data", str(corpus), "--out", str(out), "--steps", "1", *TINY]
    line = fails_cleanly(capsys, [*base, "--set", "device=cuda"], "is not available")
    assert "use --device cpu" in line
    fails_cleanly(capsys, [*base, "--device", "cuda:0"], "is not available")
    fails_cleanly(capsys, [*base, "--device", "gpu"], "must be auto, cpu or cuda")
    assert not out.exists()


def test_eval_generate_and_resume_refuse_a_missing_gpu(capsys, monkeypatch, trained, corpus):
    no_gpu(monkeypatch)
    before = snapshot(trained)
    fails_cleanly(capsys, ["eval", str(trained), "--data", str(corpus), "--device", "cuda"], "cuda")
    fails_cleanly(capsys, ["generate", str(trained), "--prompt", "a", "--device", "cuda"], "cuda")
    resume = ["train", "--resume", "--out", str(trained), "--data", str(corpus), "--no-progress"]
    fails_cleanly(capsys, [*resume, "--steps", "3", "--device", "cuda"], "is not available")
    assert snapshot(trained) == before  # the new --steps was not written either


def test_worker_and_join_refuse_a_missing_gpu_before_registering(capsys, monkeypatch, corpus):
    from blocktrain.cli import doctor, worker

    def contacted(*_args, **_kwargs):
        raise AssertionError("the aggregator was contacted")

    no_gpu(monkeypatch)
    monkeypatch.setattr(worker, "AggregatorClient", contacted)
    monkeypatch.setattr(doctor, "checks_for", contacted)
    token = ["--token", "t", "--data", str(corpus), "--device", "cuda"]
    fails_cleanly(capsys, ["worker", "--aggregator", "http://127.0.0.1:1", *token], "cuda")
    capsys.readouterr()
    fails_cleanly(capsys, ["join", "http://127.0.0.1:1", *token], "is not available")


def test_device_cpu_is_honoured_where_a_gpu_is_seen(capsys, monkeypatch, tmp_path, corpus):
    """--device cpu runs on the CPU even when torch reports a GPU (here a pretended one: were
    it used, the first tensor moved to it would fail), and train records the device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run = tmp_path / "cpu"
    args = ["--data", str(corpus), "--device", "cpu"]
    assert main(["train", "--out", str(run), "--steps", "1", *args, *TINY]) == 0
    assert json.loads((run / "config.json").read_text())["train"]["device"] == "cpu"
    capsys.readouterr()
    assert main(["eval", str(run), *args, "--bytes", "32", "--sweeps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_noise_ce"] > 0
    assert main(["generate", str(run), "--prompt", "a", "--bytes", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out
    resume = ["train", "--resume", "--out", str(run), "--steps", "2", "--no-progress", *args]
    assert main(resume) == 0


def test_no_data_says_how_to_point_at_data_as_the_readme_does(capsys, tmp_path, monkeypatch):
    """The README promised a default corpus that only the Makefile set; now both say that the
    command needs --data or $BLOCKTRAIN_DATA, and the error says how to get one."""
    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    line = fails_cleanly(capsys, ["train", "--out", str(tmp_path / "r"), *TINY], "no data given")
    assert "--data PATH or set BLOCKTRAIN_DATA=PATH" in line
    assert "blocktrain data fetch wikitext-2" in line
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert "defaults to the WikiText" not in readme
    assert "has no default corpus" in readme
    assert not (tmp_path / "r").exists()


def test_a_run_records_its_data_and_warns_when_other_data_is_given(capsys, tmp_path, corpus):
    """data.json names the corpus (path, split rule, sha256 of each split); eval, generate
    --data and train --resume say in one stderr line when the data given is not that one, and
    eval's JSON names the data it read."""
    import hashlib
    import shutil

    from tests.conftest import TEXT

    other = tmp_path / "other"
    other.mkdir()
    for split, times in (("train", 40), ("valid", 6), ("test", 6)):
        (other / f"wiki.{split}.raw").write_text(TEXT.upper() * times)
    moved = tmp_path / "moved"
    shutil.copytree(corpus, moved)
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--steps", "1", *TINY]) == 0
    record = json.loads((run / "data.json").read_text())
    assert record["path"] == str(corpus.resolve()) and record["layout"] == "wikitext"
    json_run = ["train", "--data", str(corpus), "--out", str(tmp_path / "j"), "--steps", "1"]
    capsys.readouterr()
    assert main([*json_run, "--json", *TINY]) == 0  # train's JSON names its data too
    assert json.loads(capsys.readouterr().out)["data"]["path"] == record["path"]
    assert "wiki.valid.raw" in record["split_rule"]
    assert set(record["splits"]) == {"train", "valid", "test"}
    valid_sha = hashlib.sha256((corpus / "wiki.valid.raw").read_bytes()).hexdigest()
    assert record["splits"]["valid"]["sha256"] == valid_sha
    capsys.readouterr()

    def call(*argv: str) -> tuple[str, list[str]]:
        assert main(list(argv)) == 0
        captured = capsys.readouterr()
        warnings = [line for line in captured.err.splitlines() if "warning" in line]
        return captured.out, warnings

    evaluate = ["eval", str(run), "--bytes", "32", "--sweeps", "1", "--json", "--data"]
    for same in (corpus, moved):  # the same bytes, wherever they lie: no warning
        out, warnings = call(*evaluate, str(same))
        assert warnings == []
        data = json.loads(out)["data"]
        assert data["same_as_training"] is True and data["path"] == str(same.resolve())
        assert data["splits"]["valid"]["sha256"] == valid_sha
    out, warnings = call(*evaluate, str(other))
    assert len(warnings) == 1 and warnings[0].startswith("blocktrain: warning:"), warnings
    assert "trained on other data" in warnings[0] and str(corpus.resolve()) in warnings[0]
    assert json.loads(out)["data"]["same_as_training"] is False
    out, _ = call(*evaluate[:-2], "--data", str(other))  # the table names the data too
    assert "NOT as trained" in out
    gen = ["generate", str(run), "--prompt", "a", "--bytes", "2", "--data"]
    assert call(*gen, str(corpus))[1] == []
    assert len(call(*gen, str(other))[1]) == 1
    resume = ["train", "--resume", "--out", str(run), "--steps", "2", "--no-progress"]
    assert len(call(*resume, "--data", str(other))[1]) == 1
    assert json.loads((run / "data.json").read_text()) == record  # still what it began on
