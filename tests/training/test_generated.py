"""Generated text, judged (training/generated.py) and the joint CE of whole spans."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from blocktrain.config import ModelConfig
from blocktrain.model import BlockStack, init_reference
from blocktrain.training import EvalSettings, evaluate_blocktrain
from blocktrain.training.generated import (
    GenSettings,
    byte_entropy,
    evaluate_generation,
    judge_nll,
)

CFG = ModelConfig(d_model=32, n_heads=2, layers=3, blocks=3, seq_len=16, span=1)


class CountingJudge(nn.Module):
    """Certain that each byte is the one before it plus 1 (mod 256); records its windows."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.cfg = dataclasses.replace(CFG, seq_len=seq_len)
        self.anchor = nn.Parameter(torch.zeros(()))
        self.windows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.windows.append(x.shape[1])
        logits = torch.full((*x.shape, 256), -50.0)
        return logits.scatter(-1, ((x + 1) % 256)[..., None], 50.0)


@pytest.mark.parametrize("seq_len", [8, 16, 64])
def test_the_judge_scores_every_continuation_byte_once_from_the_bytes_before_it(seq_len):
    full = (torch.arange(40)[None, :] + torch.tensor([[0], [100]])) % 256  # counting up
    judge = CountingJudge(seq_len)
    nll = judge_nll(judge, full[:, :10], full[:, 10:])  # type: ignore[arg-type]
    assert nll.shape == (2,) and float(nll.max()) < 1e-6, "aligned: every byte predicted"
    assert max(judge.windows) <= seq_len
    wrong = full[:, 10:].clone()
    wrong[:, 7] += 3  # one wrong byte costs its own prediction and the next one's
    assert float(judge_nll(judge, full[:, :10], wrong)[0]) == pytest.approx(2 * 100.0, rel=1e-3)  # type: ignore[arg-type]


def test_judge_nll_is_the_references_cross_entropy_when_it_fits_one_window():
    ref = init_reference(CFG, 0).eval()
    with torch.no_grad():
        nn.init.normal_(ref.head.weight, std=0.5)
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(ref(x)[:, 5:-1], dim=-1)  # predicts bytes 6..15
    expected = -logp.gather(-1, x[:, 6:, None])[..., 0].sum(1)
    torch.testing.assert_close(judge_nll(ref, x[:, :6], x[:, 6:]).float(), expected)


def test_byte_entropy():
    assert byte_entropy(torch.arange(256)) == pytest.approx(math.log(256))
    assert byte_entropy(torch.full((50,), 7)) == 0.0
    assert byte_entropy(torch.tensor([1, 2, 1, 2])) == pytest.approx(math.log(2))


def lively_stack(span: int) -> BlockStack:
    stack = BlockStack(dataclasses.replace(CFG, span=span), seed=5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the heads start at zero; give every block some opinion
        for p in stack.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return stack.eval()


def test_joint_ce_is_the_sampler_ce_at_span_1_and_the_single_sweep_ce_with_one_sweep():
    windows = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    one = evaluate_blocktrain(lively_stack(1), windows, EvalSettings(sweeps=4, oracle=False))
    assert one["joint_ce"] == pytest.approx(one["sampler_ce"], rel=1e-6)
    stack4 = lively_stack(4)
    single = evaluate_blocktrain(stack4, windows, EvalSettings(sweeps=1, oracle=False))
    # One sweep: -log of a product is the sum of -logs, so the joint is the single-sweep CE.
    assert single["joint_ce"] == pytest.approx(single["from_noise_ce"], rel=1e-6)
    many = evaluate_blocktrain(stack4, windows, EvalSettings(sweeps=4, oracle=False))
    # Mixing sweeps before the product differs from the per-byte marginal, and by Jensen it
    # cannot be worse than the mean single-sweep CE.
    assert many["joint_ce"] != pytest.approx(many["sampler_ce"], rel=1e-4)
    assert many["joint_ce"] <= many["from_noise_ce"] + 1e-9
    assert many["span"] == 4


def test_evaluate_generation_judges_both_kinds_of_model_on_the_same_real_text():
    judge = init_reference(dataclasses.replace(CFG, seq_len=32), 9).eval()
    with torch.no_grad():
        nn.init.normal_(judge.head.weight, std=0.2)
    windows = torch.randint(32, 127, (3, 20), generator=torch.Generator().manual_seed(2))
    settings = GenSettings(prompts=3, prompt_bytes=12, continuation_bytes=8, batch_size=2)
    bt = evaluate_generation(lively_stack(4), judge, windows, settings)
    ref = init_reference(CFG, 0).eval()
    ar = evaluate_generation(ref, judge, windows, settings)
    assert bt["floor_ce"] == ar["floor_ce"], "the same judge on the same real continuations"
    assert bt["gen_ce"] != ar["floor_ce"] and math.isfinite(bt["gen_ce"])
    assert bt["continuation_bytes"] == 8 and len(bt["samples"]) == 3
    assert bt["bytes_per_traversal"] == 4 and ar["bytes_per_traversal"] == 1, "a span a sweep"
    assert bt["real_entropy"] == ar["real_entropy"]
    again = evaluate_generation(lively_stack(4), judge, windows, settings)
    assert again["gen_ce"] == bt["gen_ce"], "seeded"
    with pytest.raises(ValueError, match="sampler"):
        GenSettings(sampler="heun")


def test_speculative_continuations_need_a_drafter_and_a_k1_model():
    import numpy as np

    from blocktrain.data.ngram import NgramDrafter

    judge = init_reference(dataclasses.replace(CFG, seq_len=32), 9).eval()
    windows = torch.randint(32, 127, (2, 20), generator=torch.Generator().manual_seed(2))
    drafter = NgramDrafter(windows.flatten().numpy().astype(np.uint8), order=2)
    settings = GenSettings(prompts=2, prompt_bytes=12, continuation_bytes=8, draft_bytes=3)
    out = evaluate_generation(lively_stack(1), judge, windows, settings, drafter)
    assert out["draft_bytes"] == 3 and math.isfinite(out["gen_ce"])
    # 8 bytes a prompt at 1 to D + 1 = 4 bytes a verify sweep: 2 to 8 sweeps each.
    assert 1 <= out["bytes_per_traversal"] <= 4
    with pytest.raises(ValueError, match="K = 1"):
        evaluate_generation(lively_stack(4), judge, windows, settings, drafter)
    with pytest.raises(ValueError, match="drafter"):
        evaluate_generation(lively_stack(1), judge, windows, settings)
