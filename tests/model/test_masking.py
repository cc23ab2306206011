"""Masked span diffusion (model/masking.py): the reveal schedule, the masked block's z path, the
reveal sampler, and the exactness of the masked joint CE against the sampler's own draws."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.errors import ConfigError
from blocktrain.model import (
    BlockStack,
    Sampling,
    SigmaSchedule,
    ZLayout,
    generate,
    stack_denoiser,
)
from blocktrain.model.block import MaskedBlock
from blocktrain.model.masking import (
    draw_masks,
    mask_interval,
    masked_count,
    masked_grid,
    masked_state,
    read_state,
)
from blocktrain.model.sampler import sampler_for
from blocktrain.training.evaluate import masked_logp

CFG = ModelConfig(
    d_model=32, n_heads=2, layers=2, blocks=2, seq_len=8, span=2, process="masked", noise_dim=16
)


def test_process_is_validated_with_one_clear_line():
    with pytest.raises(ConfigError, match="process = 'uniform' must be one of gaussian, masked"):
        ModelConfig(process="uniform")
    with pytest.raises(ConfigError, match="must be >= blocks = 3 with process=masked"):
        ModelConfig(blocks=3, span=2, seq_len=8, process="masked")


@pytest.mark.parametrize(
    ("k", "b", "s"), [(4, 3, 1), (4, 3, 2), (16, 3, 6), (16, 3, 1), (64, 3, 4)]
)
def test_the_grid_reveals_every_byte_once_block_by_block(k, b, s):
    grid = masked_grid(k, b, s)
    blocks = [p[0] for p in grid]
    assert blocks == sorted(blocks) and set(blocks) == set(range(b)), "blocks 0..B-1 in order"
    counts = [masked_count(code, k) for _, code in grid] + [0]
    assert counts[0] == k, "the sweep starts all masked"
    reveals = [a - c for a, c in itertools.pairwise(counts)]
    assert all(r >= 1 for r in reveals) and sum(reveals) == k
    for block in range(b):  # each block ends where its interval's lower end puts it
        last = max(i for i, p in enumerate(grid) if p[0] == block)
        assert counts[last + 1] == round(k * (b - 1 - block) / b)
        assert sum(1 for p in grid if p[0] == block) <= s
    if b * s >= k:
        assert reveals == [1] * k, "B S >= K: one byte per round, left to right"


def test_the_gaussian_grid_is_unchanged_by_the_masked_one():
    gaussian = dataclasses.replace(CFG, process="gaussian")
    grid = SigmaSchedule.from_config(gaussian).sampler_grid(2)
    assert grid[0][1] == gaussian.sigma_max and grid[-1][1] == gaussian.sigma_min
    assert len(grid) == 4


def test_mask_intervals_tile_the_rates_with_block_0_the_most_masked():
    assert mask_interval(0, 3, 0.0) == pytest.approx((2 / 3, 1.0))
    assert mask_interval(2, 3, 0.0) == pytest.approx((0.0, 1 / 3))
    assert mask_interval(1, 3, 0.1) == pytest.approx((1 / 3 - 1 / 30, 2 / 3 + 1 / 30))


def test_training_masks_are_random_at_rate_t_or_suffixes_of_every_span():
    x = torch.zeros(4000, 16, dtype=torch.long)
    t = torch.full((4000,), 0.5)
    masked = draw_masks(x, t, 4, torch.Generator().manual_seed(0), suffix_share=0.5)
    spans = masked.view(4000, 4, 4)
    suffix = spans.eq(torch.tensor([False, False, True, True])).all(-1).all(-1)
    assert 0.45 < float(suffix.float().mean()) < 0.55, "half the rows: the last t K of each span"
    assert float(masked[~suffix].float().mean()) == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("share, suffixes", [(1.0, 4000), (0.0, 0)])
def test_the_suffix_share_sets_how_many_rows_mask_span_suffixes(share, suffixes):
    x = torch.zeros(4000, 16, dtype=torch.long)
    masked = draw_masks(x, torch.full((4000,), 0.5), 4, torch.Generator().manual_seed(0), share)
    suffix = masked.view(4000, 4, 4).eq(torch.tensor([False, False, True, True])).all(-1).all(-1)
    assert int(suffix.sum()) == pytest.approx(suffixes, abs=40)  # a random row is rarely one


def test_the_state_determines_the_revealed_bytes_in_fp32_and_fp16():
    stack = BlockStack(CFG, 0)
    y = torch.randint(0, 256, (5, 8))
    revealed = torch.rand(5, 8) < 0.5
    z = masked_state(stack.targets, y, revealed)
    for dtype in (torch.float32, torch.float16):
        seen, read = read_state(z.to(dtype), stack.targets)
        assert torch.equal(seen, revealed) and torch.equal(read[revealed], y[revealed])


def test_only_masked_blocks_get_a_mask_token_and_it_is_what_a_masked_byte_sees():
    gaussian = BlockStack(dataclasses.replace(CFG, process="gaussian"), 0)
    assert not any("mask_token" in k for k in gaussian.state_dict())
    stack = BlockStack(CFG, 0)
    assert all(isinstance(stack.block(b), MaskedBlock) for b in range(2))
    assert {k for k in stack.state_dict() if "mask_token" in k} == {
        "blocks.0.mask_token",
        "blocks.1.mask_token",
    }
    assert not any(k.endswith(".table") for k in stack.state_dict()), "E is derived, not saved"
    block = stack.block(0)
    layout = ZLayout.training(8, 2)
    x = torch.randint(0, 256, (1, 8))
    revealed = torch.tensor([[True, False] * 4])
    h = block.z_tokens(x, masked_state(stack.targets, x, revealed), torch.ones(1), layout)
    base = block.z_tokens(x, torch.zeros(1, 8, 32), torch.ones(1), layout)  # all masked
    with torch.no_grad():
        block.mask_token.add_(1.0)
    moved = block.z_tokens(x, masked_state(stack.targets, x, revealed), torch.ones(1), layout)
    assert torch.equal(moved[:, 0::2], h[:, 0::2]), "revealed bytes do not see [MASK]"
    assert torch.allclose(moved[:, 1::2] - h[:, 1::2], torch.ones(1, 4, 32))
    assert not torch.allclose(h[:, 0::2], base[:, 0::2]), "a revealed byte enters as its embedding"


def test_samplers_fit_their_process_with_one_clear_line():
    assert sampler_for(None, "masked") == "reveal"
    assert sampler_for(None, "gaussian") == "euler"
    with pytest.raises(ValueError, match="the euler sampler does not run a masked model"):
        sampler_for("euler", "masked")
    with pytest.raises(ValueError, match="the reveal sampler does not run a gaussian model"):
        sampler_for("reveal", "gaussian")
    with pytest.raises(ValueError, match="unknown sampler 'heun'"):
        sampler_for("heun", "masked")


def random_stack(seed: int = 0, scale: float = 0.6) -> BlockStack:
    """A masked stack with random (not zero-initialised) weights: peaked, context-dependent."""
    stack = BlockStack(CFG, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return stack.eval()


def sample_spans(stack: BlockStack, prompt: list[int], n: int, sampling: Sampling) -> torch.Tensor:
    return generate(
        stack_denoiser(stack),
        torch.tensor([prompt] * n),
        CFG.span,
        grid=SigmaSchedule.from_config(CFG).sampler_grid(1),
        targets=stack.targets,
        span=CFG.span,
        max_context=CFG.seq_len - CFG.span,
        sampling=sampling,
        generator=torch.Generator().manual_seed(1),
        method="reveal",
    )


@torch.no_grad()
def test_the_masked_joint_likelihood_is_the_samplers_own_law():
    """masked_logp (the exact joint CE) scores a span as the product of its rounds'
    probabilities: the frequencies of the sampler's spans match it, and the product of the
    first round's marginals (what a one-round sampler would draw) is far off."""
    stack = random_stack()
    prompt = [10, 200, 33, 7, 99, 150]  # T - K context bytes
    n = 20000
    draws = sample_spans(stack, prompt, n, Sampling())
    spans, counts = torch.unique(draws, dim=0, return_counts=True)
    top = counts.argsort(descending=True)[:6]
    windows = torch.tensor([prompt + spans[i].tolist() for i in top])  # (6, T)
    grid = SigmaSchedule.from_config(CFG).sampler_grid(1)
    logp = masked_logp(stack, windows, grid)[0][:, -2:].sum(-1)  # the last span's log p
    freq = counts[top].double() / n
    p = logp.exp().double()
    sd = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() < 5 * sd + 1e-4).all(), (freq, p)
    # One round from the all-masked state, both bytes from their marginals: not the law.
    layout_logits = stack.block(0)(
        windows, torch.zeros(6, 8, 32), torch.full((6,), 10.0), _layout()
    )[0][:, -2:].log_softmax(-1)
    marginal = layout_logits.gather(-1, windows[:, -2:, None])[..., 0].sum(-1).exp().double()
    assert ((marginal - p).abs() > 10 * sd).any(), "a wrong factorisation would be told apart"
    assert p.sum() > 0.05, "the spans compared carry real mass"


def _layout() -> ZLayout:
    return ZLayout.training(CFG.seq_len, CFG.span)


@torch.no_grad()
def test_the_masked_joint_likelihood_sums_to_one_over_every_span():
    stack = random_stack(seed=2)
    prompt = [1, 2, 3, 4, 5, 6]
    grid = SigmaSchedule.from_config(CFG).sampler_grid(1)
    ys = torch.cartesian_prod(torch.arange(256), torch.arange(256))  # (65536, 2)
    windows = torch.cat((torch.tensor(prompt).expand(len(ys), 6), ys), dim=1)
    total = sum(
        float(masked_logp(stack, windows[i : i + 8192], grid)[0][:, -2:].sum(-1).exp().sum())
        for i in range(0, len(ys), 8192)
    )
    assert total == pytest.approx(1.0, abs=1e-4)


@torch.no_grad()
def test_reveal_keeps_revealed_bytes_and_honours_the_sampling():
    stack = random_stack(seed=3)
    prompt = [5, 6, 7, 8, 9, 10]
    greedy = sample_spans(stack, prompt, 3, Sampling(temperature=0))
    assert (greedy == greedy[0]).all(), "greedy reveals are deterministic"
    top1 = sample_spans(stack, prompt, 50, Sampling(top_k=1))
    assert (top1 == greedy[0]).all(), "top-k 1 is greedy at every round, the last included"
    hot = sample_spans(stack, prompt, 200, Sampling(temperature=5.0))
    assert len(torch.unique(hot, dim=0)) > 20


@torch.no_grad()
def test_each_round_reveals_the_leftmost_masked_bytes_and_keeps_them():
    cfg = dataclasses.replace(CFG, span=4)
    stack = BlockStack(cfg, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.6)
    seen: list[tuple[int, torch.Tensor]] = []
    inner = stack_denoiser(stack)

    def denoise(b, x, z, sigma, layout):
        seen.append((b, z.clone()))
        return inner(b, x, z, sigma, layout)

    out = generate(
        denoise,
        torch.tensor([[1, 2, 3, 4]] * 5),
        4,
        grid=SigmaSchedule.from_config(cfg).sampler_grid(2),
        targets=stack.targets,
        span=4,
        max_context=4,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(2),
        method="reveal",
    )
    assert [b for b, _ in seen] == [0, 0, 1, 1]
    for n, (_, z) in enumerate(seen):
        revealed, y = read_state(z, stack.targets)
        assert revealed.sum(-1).tolist() == [n] * 5, "one more byte per round"
        assert revealed[:, :n].all(), "the revealed bytes are a prefix (left to right)"
        assert torch.equal(y[:, :n], out[:, :n]), "what a round reveals is what comes out"
