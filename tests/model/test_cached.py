"""The cached forward of a block (model/cached.py, Block.forward_cached) gives `Block.forward`'s
logits on the whole context: for every span K, after any number of new bytes, for verify sweeps,
for several contexts of different lengths in one batch; and a wrong cache is far off."""

from __future__ import annotations

import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.model import ZLayout
from blocktrain.model.block import Block
from blocktrain.model.cached import CleanBatch, CleanCache, right_align
from blocktrain.model.speculative import verify_layout
from tests.model.test_block import randomised_block

TOL = {"rtol": 1e-4, "atol": 1e-5}


def config(span: int) -> ModelConfig:
    return ModelConfig(d_model=32, n_heads=2, layers=4, blocks=2, seq_len=32, span=span)


def layout_for(length: int, z_len: int, drafted: int) -> ZLayout:
    if drafted:
        return verify_layout(length - drafted, drafted)
    return ZLayout.next_span(length, z_len)


def cached_step(
    block: Block,
    contexts: list[torch.Tensor],
    caches: list[CleanCache | None],
    z: torch.Tensor,
    sigma: float,
    *,
    drafted: int = 0,
    fresh: int | None = None,
) -> tuple[torch.Tensor, list[CleanCache]]:
    """What a host does per sweep: reuse each cache as far as its bytes match, compute the
    rest for the batch in one pass -> (logits (N, Lz, 256), the new caches)."""
    used = [c.reusable(x) if c is not None else 0 for x, c in zip(contexts, caches, strict=True)]
    if fresh is None:
        fresh = max(x.shape[1] - p for x, p in zip(contexts, used, strict=True))
    cfg = block.cfg
    clean = CleanBatch.gather(
        [(x.shape[0], x.shape[1], c) for x, c in zip(contexts, caches, strict=True)],
        fresh,
        layers=cfg.layers_per_block,
        heads=cfg.n_heads,
        head_dim=cfg.head_dim,
    )
    x, _ = right_align(contexts)
    sigmas = torch.full((x.shape[0],), sigma)
    logits = block.forward_cached(x, z, sigmas, layout_for(x.shape[1], z.shape[1], drafted), clean)
    return logits, clean.split(contexts)


def reference(block: Block, x: torch.Tensor, z: torch.Tensor, sigma: float, drafted: int = 0):
    layout = layout_for(x.shape[1], z.shape[1], drafted)
    return block(x, z, torch.full((x.shape[0],), sigma), layout)[0]


def data(n: int, length: int, z_len: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, length), generator=gen)
    return x, torch.randn(n, z_len, d, generator=gen) * 3


@pytest.mark.parametrize("span", [1, 4])
def test_a_cache_extended_span_by_span_gives_the_full_forward(span):
    cfg = config(span)
    block = randomised_block(cfg)
    x, _ = data(2, cfg.seq_len - span, span, cfg.d_model, 0)
    cache: CleanCache | None = None
    for length in (5, 5 + span, 5 + 3 * span, 5 + 3 * span + 1, cfg.seq_len - span):
        ctx = x[:, :length]
        _, z = data(2, length, span, cfg.d_model, length)
        got, (cache,) = cached_step(block, [ctx], [cache], z, 2.5)
        torch.testing.assert_close(got, reference(block, ctx, z, 2.5), **TOL)
        assert cache.length == length and torch.equal(cache.tokens, ctx)


def test_a_wrong_cache_is_far_off():
    """The tolerance above is tight: the clean stream of other bytes, reused, is far off."""
    cfg = config(1)
    block = randomised_block(cfg)
    x, z = data(1, 20, 1, cfg.d_model, 1)
    other = x.clone()
    other[0, :10] = (other[0, :10] + 1) % 256
    _, (wrong,) = cached_step(block, [other[:, :19]], [None], z, 2.0)
    # Force the wrong cache in (a host never does: `reusable` compares the bytes).
    got, _ = cached_step(block, [x], [wrong], z, 2.0, fresh=1)
    assert (got - reference(block, x, z, 2.0)).abs().max() > 1e-2
    assert wrong.reusable(x) == 0


def test_reusable_is_the_common_prefix_of_every_row():
    cache = CleanCache(length=6, tokens=torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]]))
    x = torch.tensor([[1, 2, 3, 4, 7, 7, 7], [1, 2, 3, 9, 9, 9, 9]])
    assert cache.reusable(x) == 4  # the first row differs from position 4
    assert cache.reusable(x[:, :2]) == 2  # a shorter context: what it holds
    assert cache.reusable(x[:1]) == 0  # other rows: nothing
    assert cache.reusable(torch.tensor([[5, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]])) == 0


@pytest.mark.parametrize("drafted", [1, 3])
def test_verify_sweeps_cut_back_to_the_accepted_bytes(drafted):
    """A verify sweep caches the context and its draft; the next one (some drafted bytes
    rejected, another byte in their place, a new draft) reuses the common part."""
    cfg = config(1)
    block = randomised_block(cfg)
    x, z = data(1, 12 + drafted, drafted + 1, cfg.d_model, 2)
    got, (cache,) = cached_step(block, [x], [None], z, 3.0, drafted=drafted)
    torch.testing.assert_close(got, reference(block, x, z, 3.0, drafted), **TOL)
    accepted = drafted - 1
    nxt, z2 = data(1, 13 + accepted + drafted, drafted + 1, cfg.d_model, 3)
    nxt[:, : 12 + accepted] = x[:, : 12 + accepted]
    nxt[0, 12 + accepted] = (x[0, 12 + accepted] + 1) % 256  # the draw after a rejection
    assert cache.reusable(nxt) == 12 + accepted
    got2, _ = cached_step(block, [nxt], [cache], z2, 3.0, drafted=drafted)
    torch.testing.assert_close(got2, reference(block, nxt, z2, 3.0, drafted), **TOL)


@pytest.mark.parametrize(("span", "drafted"), [(1, 0), (4, 0), (1, 2)])
def test_contexts_of_different_lengths_share_one_forward_pass(span, drafted):
    """Rows right-aligned and masked, each with its own positions: every job gets its own
    forward's logits, whatever it was batched with (with or without a cache, fresh or not)."""
    cfg = config(span)
    block = randomised_block(cfg)
    z_len = drafted + 1 if drafted else span
    lengths, rows = [7, 19, 3 + drafted, 19, 12], [1, 2, 1, 1, 3]
    contexts = [
        data(n, lj, z_len, cfg.d_model, 10 + j)[0]
        for j, (n, lj) in enumerate(zip(rows, lengths, strict=True))
    ]
    # Job 1 has a cache of its context less 2 bytes, job 3 one of all of it (a retry), job 4
    # one of other bytes; the others none.
    caches: list[CleanCache | None] = [None] * len(contexts)
    for j, keep in ((1, 17), (3, 19)):
        _, (caches[j],) = cached_step(
            block, [contexts[j][:, :keep]], [None], data(rows[j], 1, z_len, cfg.d_model, 0)[1], 2.0
        )
    _, (caches[4],) = cached_step(
        block, [torch.zeros_like(contexts[4])], [None], data(3, 1, z_len, cfg.d_model, 0)[1], 2.0
    )
    _, z = data(sum(rows), 1, z_len, cfg.d_model, 5)
    got, new = cached_step(block, contexts, caches, z, 1.7, drafted=drafted)
    row = 0
    for j, x in enumerate(contexts):
        zj = z[row : row + x.shape[0]]
        want = reference(block, x, zj, 1.7, drafted)
        torch.testing.assert_close(got[row : row + x.shape[0]], want, **TOL)
        row += x.shape[0]
        # each job's new cache is its own clean stream: it gives the same logits again
        again, _ = cached_step(block, [x], [new[j]], zj, 1.7, drafted=drafted)
        torch.testing.assert_close(again, want, **TOL)
        assert new[j].length == x.shape[1] and new[j].keys[0].is_contiguous()


def test_a_second_point_of_the_same_block_reuses_the_whole_clean_stream():
    """steps_per_block > 1: after the first call the batch holds every index (fresh = 0)."""
    cfg = config(4)
    block = randomised_block(cfg)
    contexts = [data(1, 9, 4, cfg.d_model, 1)[0], data(2, 14, 4, cfg.d_model, 2)[0]]
    clean = CleanBatch.gather(
        [(1, 9, None), (2, 14, None)],
        14,
        layers=cfg.layers_per_block,
        heads=cfg.n_heads,
        head_dim=cfg.head_dim,
    )
    x, _ = right_align(contexts)
    layout = ZLayout.next_span(14, 4)
    for sigma, seed in ((5.0, 3), (1.5, 4)):
        _, z = data(3, 1, 4, cfg.d_model, seed)
        got = block.forward_cached(x, z, torch.full((3,), sigma), layout, clean)
        assert clean.fresh == 0
        for rows, ctx in ((slice(0, 1), contexts[0]), (slice(1, 3), contexts[1])):
            torch.testing.assert_close(got[rows], reference(block, ctx, z[rows], sigma), **TOL)


def test_the_sigma_terms_follow_weights_changed_in_place():
    """The cached pass keeps each sigma's adaLN terms; weights loaded or trained in place after
    a pass must not be served the old terms."""
    cfg = config(1)
    block = randomised_block(cfg)
    x, z = data(1, 10, 1, cfg.d_model, 4)
    before, _ = cached_step(block, [x], [None], z, 2.0)
    with torch.no_grad():
        for p in (
            block.noise_mlp[0].weight,
            block.layers[0].modulation.weight,
            block.final_mod.bias,
        ):
            p.add_(0.3 * torch.randn_like(p))
            after, _ = cached_step(block, [x], [None], z, 2.0)
            torch.testing.assert_close(after, reference(block, x, z, 2.0), **TOL)
            assert not torch.allclose(after, before, **TOL), "the change moves the logits"
            before = after
