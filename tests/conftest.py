"""Shared fixtures: a small text corpus written per test, and tiny configs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from blocktrain.config import ModelConfig, RunConfig, TrainConfig

# The tests' models are micro: torch's spinning intra-op threads only cost time on them, and on
# a shared 2-core machine they make the suite several times slower than one thread does (tests/
# model and tests/training beside two busy processes: 571 s at 2 threads, 127 s at 1). Set here,
# before any fixture trains a run, and again after every test that changed it (a command's
# --threads).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    yield
    torch.set_num_threads(1)


TEXT = (
    " = Valkyria Chronicles III = \n\n Senjo no Valkyria 3 : Unrecorded Chronicles is a tactical "
    "role @-@ playing video game developed by Sega and Media.Vision for the PlayStation Portable . "
    "Released in January 2011 in Japan , it is the third game in the Valkyria series . \n"
)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A WikiText-style folder with the three splits."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "wiki.train.raw").write_text(TEXT * 40)
    (root / "wiki.valid.raw").write_text(TEXT * 6)
    (root / "wiki.test.raw").write_text(TEXT * 6)
    return root


def micro_config(route: str | None = None, **train: object) -> RunConfig:
    """A configuration that trains in well under a second per step on CPU (`route`: another
    than the default, relay, for a test of what a features or state worker does)."""
    base = RunConfig(
        preset="micro",
        seed=3,
        model=ModelConfig(d_model=32, n_heads=2, layers=3, blocks=3, seq_len=16, span=2),
        train=TrainConfig(
            steps=6,
            batch_size=4,
            lr=3e-3,
            warmup_steps=2,
            eval_every=0,
            eval_bytes=128,
            eval_sweeps=2,
            checkpoint_every=3,
            log_every=1,
        ),
    )
    if route is not None:
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, route=route))
    return dataclasses.replace(base, train=dataclasses.replace(base.train, **train))
