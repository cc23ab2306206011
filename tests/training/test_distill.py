"""Distilling a drafter towards the K = 1 sampler's law (training/distill.py, `blocktrain
distill`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from blocktrain.cli.main import main
from blocktrain.model import BlockStack, Reference
from blocktrain.model.speculative import ModelDrafter
from blocktrain.training import Trainer, load_model
from blocktrain.training.distill import Teacher, TeacherSpec
from tests.cli.test_cli import TINY, fails_cleanly
from tests.conftest import micro_config
from tests.training.test_trainer import losses, splits


def k1_config(**train: object):
    cfg = micro_config(**train)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, span=1))


@pytest.fixture
def runs(tmp_path, corpus):
    """A K = 1 BlockTrain teacher trained on upper-cased text, so that its law is far from the
    text's, and an autoregressive student trained a few steps on the text."""
    upper = tmp_path / "upper"
    upper.mkdir()
    for f in corpus.iterdir():
        (upper / f.name).write_text(f.read_text().upper())
    Trainer.create(k1_config(steps=40, lr=1e-2), tmp_path / "k1", *splits(upper)).run(
        progress=False
    )
    train, valid = splits(corpus)
    student = k1_config(steps=4)
    Trainer.create(student, tmp_path / "student", train, valid, kind="reference").run(
        progress=False
    )
    return tmp_path / "k1", tmp_path / "student"


def ce_to_teacher(student: Reference, teacher: Teacher, windows: torch.Tensor) -> float:
    """The student's cross-entropy to the teacher's law (32 sweeps' mean) on windows."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        q = sum(teacher.probs(windows, gen) for _ in range(32)) / 32
        log_r = torch.log_softmax(student(windows)[:, :-1].float(), dim=-1)
    return float(-(q * log_r).sum(-1).mean())


def test_distilling_moves_the_student_towards_the_samplers_law_more_than_the_text_does(
    tmp_path, corpus, runs
):
    """The same number of updates from the same student: towards the teacher's law (one sweep
    per batch) against more training on the text."""
    k1, student = runs
    train, valid = splits(corpus)
    cfg = dataclasses.replace(
        load_model(student)[0].config, train=k1_config(steps=40, lr=1e-2).train
    )
    spec = TeacherSpec(str(k1))
    distilled = Trainer.create(
        cfg, tmp_path / "kd", train, valid, kind="reference", teacher=spec, init_from=student
    )
    distilled.run(progress=False)
    on_text = Trainer.create(
        cfg, tmp_path / "text", train, valid, kind="reference", init_from=student
    )
    on_text.run(progress=False)

    teacher = Teacher(spec, cfg.model.seq_len, torch.device("cpu"))
    windows = valid.windows(cfg.model.seq_len, 8 * cfg.model.seq_len)
    before = ce_to_teacher(load_model(student)[1], teacher, windows)
    after_kd = ce_to_teacher(load_model(tmp_path / "kd")[1], teacher, windows)
    after_text = ce_to_teacher(load_model(tmp_path / "text")[1], teacher, windows)
    assert after_kd < before - 0.5 and after_kd < after_text - 0.5, (before, after_kd, after_text)
    assert TeacherSpec.read(tmp_path / "kd") == spec and TeacherSpec.read(tmp_path / "text") is None


def test_a_distillation_resumes_with_its_teacher_and_reproduces_the_run(tmp_path, corpus, runs):
    k1, student = runs
    train, valid = splits(corpus)
    cfg = dataclasses.replace(load_model(student)[0].config, train=k1_config(steps=6).train)
    spec = TeacherSpec(str(k1), "ancestral")
    for name, until in (("full", None), ("half", 3)):
        trainer = Trainer.create(
            cfg, tmp_path / name, train, valid, kind="reference", teacher=spec, init_from=student
        )
        trainer.run(progress=False, until=until)
    resumed = Trainer.resume(tmp_path / "half", train, valid)
    assert resumed.step == 3 and resumed.teacher == spec
    resumed.run(progress=False)
    # The teacher's sweep noise is seeded by the step, like the batch: exact in one process.
    assert losses(tmp_path / "half") == losses(tmp_path / "full")


def test_the_distill_command_makes_a_drafter_and_refuses_what_cannot_teach(
    tmp_path, corpus, capsys
):
    data = ["--data", str(corpus)]
    for name, span in (("k1", "span=1"), ("k2", "span=2")):
        argv = ["train", *data, "--out", str(tmp_path / name), "--steps", "2", *TINY]
        assert main([*argv, "--set", span]) == 0
    drafter = ["train", *data, "--reference", "--out", str(tmp_path / "d"), "--steps", "2", *TINY]
    assert main(drafter) == 0
    capsys.readouterr()
    out = tmp_path / "kd"
    argv = ["distill", *data, "--teacher", str(tmp_path / "k1"), "--student", str(tmp_path / "d")]
    assert main([*argv, "--out", str(out), "--steps", "3", "--lr", "5e-4", "--no-progress"]) == 0
    assert "distilled" in capsys.readouterr().out
    # its data recorded as train records it, so eval and --resume can tell other data
    assert json.loads((out / "data.json").read_text())["path"] == str(corpus.resolve())
    info, model = load_model(out)
    assert info.kind == "reference" and info.config.train.steps == 3
    assert info.config.train.lr == 5e-4  # --lr, the distillation's peak learning rate
    assert isinstance(model, Reference)
    ModelDrafter(model).draft(list(b"The "), 4, torch.Generator().manual_seed(0))
    assert main(["distill", *data, "--resume", "--out", str(out), "--steps", "4", "-q"]) == 0
    assert load_model(out)[0].config.train.steps == 4
    assert "warning" not in capsys.readouterr().err  # the data it was distilled on
    # --device, as train's: a device this machine lacks is one line before anything is written
    fails_cleanly(capsys, [*argv, "--out", str(tmp_path / "y"), "--device", "cuda:7"], "cuda:7")
    assert not (tmp_path / "y").exists()

    fails_cleanly(
        capsys,
        [
            "distill",
            *data,
            "--teacher",
            str(tmp_path / "k1"),
            "--student",
            str(tmp_path / "k1"),
            "--out",
            str(tmp_path / "x"),
        ],
        "autoregressive run",
    )
    fails_cleanly(
        capsys,
        [
            "distill",
            *data,
            "--teacher",
            str(tmp_path / "k2"),
            "--student",
            str(tmp_path / "d"),
            "--out",
            str(tmp_path / "x"),
        ],
        "K = 1",
    )
    fails_cleanly(
        capsys,
        [*argv, "--out", str(tmp_path / "x"), "--sampler", "heun"],
        "sampler",
    )
    fails_cleanly(capsys, ["distill", "--resume", "--out", str(tmp_path / "d")], "not a distil")
    fails_cleanly(capsys, ["distill", "--out", str(tmp_path / "x")], "--teacher")
    assert not (tmp_path / "x").exists(), "a refused distillation leaves nothing behind"
    assert isinstance(load_model(tmp_path / "k1")[1], BlockStack)
