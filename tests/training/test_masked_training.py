"""Training a masked run (`process = masked`): the block-local loss written out by hand, the
trainer's run saved and reloaded with its process, evaluation exact, old configs still loading,
and the CLI's refusals of a sampler that does not fit."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from blocktrain.cli.main import main
from blocktrain.config import RunConfig
from blocktrain.data import load_split
from blocktrain.model import BlockStack, target_table
from blocktrain.model.masking import draw_masks, mask_interval, masked_state
from blocktrain.training import BlockLoss, EvalSettings, Trainer, evaluate_blocktrain, load_model
from blocktrain.training.plan import plan
from tests.cli.test_cli import TINY, fails_cleanly
from tests.conftest import TEXT, micro_config
from tests.training.test_loss import LinearBlock, hand_ce

N, BLOCK, SEED = 6, 1, 5


def masked_model(**changes: object):
    cfg = micro_config("state")  # a stand-in block: the route only adds what it reads
    return dataclasses.replace(cfg.model, span=4, process="masked", **changes)


@pytest.mark.parametrize("mask_loss", ["elbo", "mean"])
def test_masked_loss_equals_the_hand_written_loss(mask_loss):
    model = masked_model(aux_weight=0.5, mask_loss=mask_loss)
    targets = target_table(0, model.d_model)
    x = torch.randint(0, 256, (N, model.seq_len), generator=torch.Generator().manual_seed(1))
    block = LinearBlock(model.d_model)
    parts = BlockLoss(model, targets)(block, BLOCK, x, torch.Generator().manual_seed(SEED))
    (call,) = block.calls

    # The same draws in the loss's order: t in the block's interval (at least 1/K), the masks.
    gen = torch.Generator().manual_seed(SEED)
    lo, hi = mask_interval(BLOCK, model.blocks, model.overlap)
    lo = max(lo, 1 / model.span)
    t = lo + (hi - lo) * torch.rand(N, generator=gen)
    masked = draw_masks(x, t, model.span, gen, model.mask_suffix_share)
    z = masked_state(targets, x, ~masked)
    assert torch.equal(call["z"], z), "revealed bytes enter as E[y], masked ones as 0"
    assert torch.allclose(call["sigma"], 10.0**t), "the block sees t as sigma = 10^t"
    ce = hand_ce(z @ block.to_logits, x) * masked  # (N, T): only the masked bytes count
    if mask_loss == "elbo":
        denoise = (ce.sum(1) / t.double()).sum() / x.numel()
    else:
        denoise = ce.sum() / masked.sum()
    aux = hand_ce(block.aux_table[x][:, :-1], x[:, 1:]).mean()
    expected = denoise + 0.5 * aux
    assert float(parts.total) == pytest.approx(float(expected), rel=1e-5)
    assert parts.logs["loss_denoise"] == pytest.approx(float(ce.sum() / masked.sum()), rel=1e-5)


def test_a_masked_run_trains_saves_its_process_and_evaluates_exactly(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "wiki.train.raw").write_text(TEXT * 40)
    train = load_split(corpus, "train")
    cfg = micro_config(steps=4)
    cfg = dataclasses.replace(cfg, model=masked_model())
    Trainer.create(cfg, tmp_path / "run", train, None, kind="blocktrain").run(progress=False)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["process"] == "masked"
    info, model = load_model(tmp_path / "run")
    assert isinstance(model, BlockStack) and info.config.model.process == "masked"
    assert any(
        float(p.detach().abs().sum()) > 0 for n, p in model.named_parameters() if "mask_token" in n
    )
    windows = train.windows(16, 16 * 8)
    one = evaluate_blocktrain(model, windows, EvalSettings(steps_per_block=1, sweeps=4))
    again = evaluate_blocktrain(model, windows, EvalSettings(steps_per_block=1, seed=9))
    assert one["joint_ce"] == again["joint_ce"] == one["sampler_ce"], "exact: no sweeps, no seed"
    assert one["sampler"] == "reveal" and one["oracle_ce"] is None
    assert len(one["ce_per_step"]) == 3
    with pytest.raises(ValueError, match="the euler sampler does not run a masked model"):
        evaluate_blocktrain(model, windows, EvalSettings(sampler="euler"))


def test_configs_written_before_masking_load_as_gaussian():
    data = micro_config().to_dict()
    del data["model"]["process"], data["model"]["mask_loss"]
    cfg = RunConfig.from_dict(data)
    assert cfg.model.process == "gaussian"
    assert type(BlockStack(cfg.model, 0).block(0)).__name__ == "Block"


def test_the_cli_trains_a_masked_run_and_refuses_gaussian_samplers(capsys, tmp_path, corpus):
    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--out", str(run), "--steps", "2", *TINY]
    assert main([*argv, "--set", "process=masked", "span=4"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "ab", "--bytes", "6"]) == 0
    assert len(capsys.readouterr().out.encode("utf-8", "replace")) >= 6
    fails_cleanly(
        capsys,
        ["generate", str(run), "--prompt", "a", "--sampler", "euler"],
        "the euler sampler does not run a masked model; choose reveal",
    )
    fails_cleanly(
        capsys,
        ["eval", str(run), "--data", str(corpus), "--sampler", "ancestral"],
        "the ancestral sampler does not run a masked model",
    )
    fails_cleanly(
        capsys,
        [
            "train",
            "--data",
            str(corpus),
            "--out",
            str(tmp_path / "x"),
            *TINY,
            "--set",
            "process=uniform",
        ],
        "process = 'uniform' must be one of gaussian, masked",
    )


def test_plan_counts_the_mask_token_of_masked_blocks():
    gaussian = micro_config()
    masked = dataclasses.replace(gaussian, model=masked_model())
    extra = plan(masked)["params_per_block"][0] - plan(gaussian)["params_per_block"][0]
    assert extra == gaussian.model.d_model
