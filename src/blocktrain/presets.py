"""The named presets (`--preset NAME`), from a minute on two CPU cores to one GPU. Every preset
takes the model's default `route = relay` (blocks that compose, docs/model.md); `--set
route=features` reruns the blocks before instead, `--set route=state` is DiffusionBlocks'
original, which does not compose."""

from __future__ import annotations

import typing

from blocktrain.config import ModelConfig, RunConfig, TrainConfig
from blocktrain.errors import ConfigError


def tiny() -> RunConfig:
    """Learns visibly on two CPU cores in about two minutes: for smoke tests and the README."""
    return RunConfig(
        preset="tiny",
        model=ModelConfig(d_model=128, n_heads=4, layers=3, blocks=3, seq_len=64, span=1),
        train=TrainConfig(
            steps=300, batch_size=32, lr=2e-3, warmup_steps=30, eval_every=100, checkpoint_every=100
        ),
    )


def small() -> RunConfig:
    """About 30 minutes on two CPU cores: 3 blocks of 2 layers, d = 256."""
    return RunConfig(
        preset="small",
        model=ModelConfig(d_model=256, n_heads=4, layers=6, blocks=3, seq_len=128, span=1),
        train=TrainConfig(
            steps=1000,
            batch_size=32,
            lr=1.5e-3,
            warmup_steps=100,
            eval_every=250,
            eval_bytes=32768,
            checkpoint_every=250,
            log_every=20,
        ),
    )


def paper() -> RunConfig:
    """The seed's shape, B = 3 blocks of 4 layers, sized for one GPU."""
    return RunConfig(
        preset="paper",
        model=ModelConfig(d_model=768, n_heads=12, layers=12, blocks=3, seq_len=512, span=1),
        train=TrainConfig(
            steps=20000,
            batch_size=32,
            lr=6e-4,
            warmup_steps=1000,
            eval_every=1000,
            eval_bytes=262144,
            eval_sweeps=8,
            checkpoint_every=1000,
            log_every=50,
            precision="bf16",
        ),
    )


def judge() -> RunConfig:
    """The fixed judge of generated text (docs/model.md, "Evaluation"): train it with
    `--reference`. An autoregressive byte model of the small width, 6 layers, T = 256 (a 128-byte
    prompt and its 128-byte continuation in one window), with its own seed so that it is trained
    apart from every model it judges. About an hour on two CPU cores. A reference has one
    unit, so the route does not change it."""
    return RunConfig(
        preset="judge",
        seed=1,
        model=ModelConfig(d_model=256, n_heads=4, layers=6, blocks=3, seq_len=256, span=1),
        train=TrainConfig(
            steps=3000,
            batch_size=16,
            lr=1.5e-3,
            warmup_steps=100,
            eval_every=500,
            eval_bytes=32768,
            checkpoint_every=250,
            log_every=50,
        ),
    )


PRESETS: dict[str, typing.Callable[[], RunConfig]] = {
    "tiny": tiny,
    "small": small,
    "paper": paper,
    "judge": judge,
}


def preset(name: str) -> RunConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
