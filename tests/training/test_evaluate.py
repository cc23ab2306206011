"""The quality figures of evaluate_blocktrain (docs/model.md, "Evaluation")."""

from __future__ import annotations

import math

import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.model import BlockStack
from blocktrain.training import EvalSettings, evaluate_blocktrain

CFG = ModelConfig(d_model=32, n_heads=2, layers=3, blocks=3, seq_len=16, span=1)


@pytest.fixture
def stack() -> BlockStack:
    model = BlockStack(CFG, seed=5, blocks=[0, 1, 2])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the heads start at zero; give every block some opinion
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture
def windows() -> torch.Tensor:
    return torch.randint(0, 256, (6, CFG.seq_len), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("sampler", ["euler", "ancestral"])
def test_sampler_ce_per_step_is_the_mixture_at_every_grid_point(stack, windows, sampler):
    ev = evaluate_blocktrain(
        stack, windows, EvalSettings(sweeps=4, steps_per_block=2, batch_size=4, sampler=sampler)
    )
    per_step, mix = ev["ce_per_step"], ev["sampler_ce_per_step"]
    assert len(mix) == len(per_step) == 6
    assert mix[-1] == pytest.approx(ev["sampler_ce"], rel=1e-6)
    for single, mixed in zip(per_step, mix, strict=True):
        assert math.isfinite(mixed)
        assert mixed <= single + 1e-6  # -log of a mean never exceeds the mean of -log


def test_one_sweep_mixture_is_the_single_sweep_ce(stack, windows):
    ev = evaluate_blocktrain(stack, windows, EvalSettings(sweeps=1, batch_size=4))
    assert ev["sampler_ce_per_step"] == pytest.approx(ev["ce_per_step"], rel=1e-5)
    assert ev["sampler_ce"] == pytest.approx(ev["from_noise_ce"], rel=1e-5)


def test_sampler_ce_by_sweeps_uses_the_first_sweeps(stack, windows):
    ev = evaluate_blocktrain(stack, windows, EvalSettings(sweeps=5, batch_size=8))
    by_m = ev["sampler_ce_by_sweeps"]
    assert list(by_m) == ["1", "2", "4"]
    one = evaluate_blocktrain(stack, windows, EvalSettings(sweeps=1, batch_size=8))
    assert one["sampler_ce_by_sweeps"] == {}
    # one batch: its first sweep draws the same noise whatever M is
    assert by_m["1"] == pytest.approx(one["sampler_ce"], rel=1e-5)


def test_the_ce_summary_of_a_wrecked_model_has_an_infinite_perplexity():
    """Regression: bench/adversarial.py's undefended ascend row ended at a CE past 709 nats,
    and math.exp raised OverflowError, losing the row."""
    import math

    from blocktrain.training.evaluate import ce_summary

    assert ce_summary(1000.0) == {"bits_per_byte": 1000.0 / math.log(2), "perplexity": math.inf}
    assert ce_summary(2.0)["perplexity"] == math.exp(2.0)
