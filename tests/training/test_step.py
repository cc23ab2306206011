"""The one training step: the trainer and a worker's local trainer take it, precision included."""

from __future__ import annotations

import pytest
import torch

from blocktrain.config import RunConfig
from blocktrain.data import load_split
from blocktrain.model import init_block
from blocktrain.training import Trainer
from blocktrain.training.local import LocalBlockTrainer
from blocktrain.training.step import precision_context
from tests.conftest import micro_config

BLOCK = 1
PRECISIONS = pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)]
)


def head_dtypes(module: torch.nn.Module) -> list[torch.dtype]:
    """Record the dtype of the output head's activations on every forward."""
    seen: list[torch.dtype] = []
    head = module.get_submodule("head")
    head.register_forward_hook(lambda _m, _inp, out: seen.append(out.dtype))
    return seen


def upstream_of(cfg: RunConfig) -> dict[int, dict[str, torch.Tensor]]:
    """The initial versions of the blocks before BLOCK, which it reads under route = features."""
    return {b: init_block(cfg.model, cfg.seed, b).state_dict() for b in range(BLOCK)}


@PRECISIONS
def test_precision_reaches_the_local_trainer(corpus, precision, dtype):
    cfg = micro_config("features", precision=precision)
    local = LocalBlockTrainer(cfg, BLOCK, load_split(corpus, "train"), data_seed=cfg.seed)
    local.load_upstream(upstream_of(cfg))
    seen = head_dtypes(local.module)
    local.train(1, first_step=0)
    assert seen == [dtype], f"precision={precision}: the head ran in {seen}, wanted {dtype}"


@PRECISIONS
def test_precision_reaches_the_trainer(tmp_path, corpus, precision, dtype):
    cfg = micro_config(precision=precision)
    trainer = Trainer.create(cfg, tmp_path / "r", load_split(corpus, "train"), None, blocks=[0])
    seen = head_dtypes(trainer.units[0].module)
    trainer.train_step()
    assert seen == [dtype], f"precision={precision}: the head ran in {seen}, wanted {dtype}"
    with trainer.autocast():
        assert torch.is_autocast_enabled("cpu") == (precision == "bf16")


def test_precision_context():
    with precision_context("fp32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    with precision_context("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_workers_steps_are_the_trainers_steps(tmp_path, corpus, precision):
    """A worker whose data seed is the run seed, starting from the run's initial block, takes the
    trainer's updates. Both run `step.train_step` on the same shapes in one process, so the
    weights agree exactly (tolerance 0): any difference is a second code path, not rounding."""
    cfg = micro_config("features", precision=precision)
    train = load_split(corpus, "train")
    # route = features: both read block 0's initial version, frozen (the trainer from a run
    # of block 0 that has not trained, the worker as a pulled version)
    Trainer.create(cfg, tmp_path / "b0", train, None, blocks=[0]).save_checkpoint()
    trainer = Trainer.create(
        cfg, tmp_path / "r", train, None, blocks=[BLOCK], upstream_from=[tmp_path / "b0"]
    )
    local = LocalBlockTrainer(cfg, BLOCK, train, data_seed=cfg.seed)
    local.load(trainer.units[0].module.state_dict())
    local.load_upstream(upstream_of(cfg))
    trainer_logs = []
    for _ in range(3):  # past warmup, so the learning-rate schedule is exercised too
        trainer_logs.append(trainer.train_step()["loss"])
        trainer.step += 1
    local_logs = local.train(3, first_step=0)
    assert local_logs["loss"] == sum(trainer_logs) / 3
    want = trainer.units[0].module.state_dict()
    for name, value in local.module.state_dict().items():
        torch.testing.assert_close(
            value, want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert any(float(d.abs().max()) > 0 for d in local.delta().values()), "the steps moved it"
