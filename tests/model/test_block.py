import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.model import BlockStack, ZLayout, init_block, target_table

CFG = ModelConfig(d_model=32, n_heads=2, layers=2, blocks=2, seq_len=16, span=4)


def randomised_block(cfg: ModelConfig = CFG, seed: int = 0):
    """A block whose zero-initialised parts are made non-zero, so every path carries signal."""
    block = init_block(cfg, seed=seed, index=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return block.eval()


def run(block, x, z, sigma=2.0, cfg=CFG):
    layout = ZLayout.training(cfg.seq_len, cfg.span)
    logits, aux = block(x, z, torch.full((x.shape[0],), sigma), layout, with_aux=True)
    return logits, aux


def span_end(i: int, k: int) -> int:
    return (i // k + 1) * k


@pytest.mark.parametrize("i", [0, 3, 5, 10, 15])
def test_changing_a_clean_byte_moves_only_later_spans(i):
    block = randomised_block()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (1, CFG.seq_len), generator=gen)
    z = torch.randn(1, CFG.seq_len, CFG.d_model, generator=gen)
    x2 = x.clone()
    x2[0, i] = (x[0, i] + 17) % 256
    a, aux_a = run(block, x, z)
    b, aux_b = run(block, x2, z)
    moved = (a - b).abs().amax(dim=-1)[0]  # (T,)
    end = span_end(i, CFG.span)
    assert (moved[:end] == 0).all(), f"byte {i} leaked into its own span or earlier: {moved}"
    if end < CFG.seq_len:
        # the next span sees the changed byte directly (further ones may underflow to 0 in fp32)
        assert moved[end : end + CFG.span].min() > 0, "later spans must see the changed context"
    aux_moved = (aux_a - aux_b).abs().amax(dim=-1)[0]
    assert (aux_moved[:i] == 0).all(), "the clean stream is causal"
    assert aux_moved[i:].min() > 0


@pytest.mark.parametrize("i", [0, 6, 13])
def test_a_noisy_state_reaches_only_its_own_span(i):
    block = randomised_block()
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (1, CFG.seq_len), generator=gen)
    z = torch.randn(1, CFG.seq_len, CFG.d_model, generator=gen)
    z2 = z.clone()
    z2[0, i] += 1.0
    a, aux_a = run(block, x, z)
    b, aux_b = run(block, x, z2)
    moved = (a - b).abs().amax(dim=-1)[0]
    start, end = (i // CFG.span) * CFG.span, span_end(i, CFG.span)
    assert moved[start:end].min() > 0, "the span is bidirectional over its noisy states"
    assert (moved[:start] == 0).all() and (moved[end:] == 0).all(), moved
    assert torch.equal(aux_a, aux_b), "nothing flows from z to the clean stream"


def test_span_one_is_next_byte_prediction():
    cfg = ModelConfig(d_model=32, n_heads=2, layers=2, blocks=2, seq_len=8, span=1)
    block = randomised_block(cfg)
    x = torch.randint(0, 256, (1, 8))
    z = torch.randn(1, 8, 32)
    for i in range(8):
        x2 = x.clone()
        x2[0, i] = (x[0, i] + 1) % 256
        moved = (run(block, x, z, cfg=cfg)[0] - run(block, x2, z, cfg=cfg)[0]).abs().amax(-1)[0]
        assert moved[: i + 1].max() == 0 and (i == 7 or moved[i + 1 :].min() > 0)


def test_generation_layout_matches_the_training_layout():
    """The last span of a training pass equals a generation pass over the same context."""
    block = randomised_block()
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (2, CFG.seq_len), generator=gen)
    z = torch.randn(2, CFG.seq_len, CFG.d_model, generator=gen)
    full, _ = run(block, x, z)
    ctx = CFG.seq_len - CFG.span
    layout = ZLayout.next_span(ctx, CFG.span)
    part, _ = block(x[:, :ctx], z[:, ctx:], torch.full((2,), 2.0), layout)
    torch.testing.assert_close(part, full[:, ctx:], rtol=1e-4, atol=1e-5)


def test_fresh_block_predicts_uniform_bytes():
    block = init_block(CFG, seed=0, index=0)
    logits, _ = run(block, torch.randint(0, 256, (1, 16)), torch.randn(1, 16, 32))
    assert logits.abs().max() == 0, "the zero-initialised head starts at the uniform distribution"


def test_blocks_are_seeded_independently_of_which_others_exist():
    full = BlockStack(CFG, seed=5)
    alone = BlockStack(CFG, seed=5, blocks=[1])
    for name, value in alone.block(1).state_dict().items():
        assert torch.equal(value, full.block(1).state_dict()[name]), name
    assert not torch.equal(full.block(0).embed.weight, full.block(1).embed.weight)


def test_target_table_is_unit_norm_and_seeded():
    a, b, c = target_table(0, 64), target_table(0, 64), target_table(1, 64)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(a.norm(dim=1), torch.ones(256))
