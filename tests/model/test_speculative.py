"""Speculative generation: the n-gram drafter's law, the verify layout's visibility, and the
exactness of draft-and-verify against plain K = 1 sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.data.ngram import NgramDrafter
from blocktrain.model import Sampling, SigmaSchedule, generate, init_reference
from blocktrain.model.sampler import Fork, antithetic_normal, fork_step, one_sweep
from blocktrain.model.speculative import (
    ModelDrafter,
    accept_draft,
    generate_speculative,
    verify_fork,
    verify_layout,
)
from tests.model.test_block import randomised_block

CFG = ModelConfig(d_model=8, n_heads=2, layers=3, blocks=3, seq_len=16, span=1)
TARGETS = torch.nn.functional.normalize(
    torch.randn(256, 8, generator=torch.Generator().manual_seed(0)), dim=1
)


def test_the_drafter_is_a_distribution_that_knows_its_contexts():
    data = np.frombuffer(b"abcabcabcabd" * 50, dtype=np.uint8)
    drafter = NgramDrafter(data, order=3)
    p = drafter.probs(list(b"ab"))
    assert p.shape == (256,) and p.sum() == pytest.approx(1.0)
    assert p[ord("c")] > 0.5 and p[ord("d")] > p[ord("e")] > 0, "seen > rarely seen > unseen"
    assert drafter.probs(list(b"zz")).argmax() in (ord("a"), ord("b"), ord("c")), "backs off"
    bytes_, laws = drafter.draft(list(b"ab"), 5, torch.Generator().manual_seed(0))
    assert len(bytes_) == 5 and laws.shape == (5, 256)
    assert torch.allclose(laws[0], torch.from_numpy(p).float())
    with pytest.raises(ValueError, match="order"):
        NgramDrafter(data, order=8)


def test_a_verified_position_sees_the_context_and_the_draft_before_it_only():
    layout = verify_layout(context_len=5, drafted=3)
    assert layout.z_pos.tolist() == [5, 6, 7, 8]
    to_x = layout.mask[:, :8]  # clean keys: 5 context bytes + 3 drafted
    assert to_x.sum(1).tolist() == [5, 6, 7, 8], "z_i sees x_<P+i: never d_i itself"
    to_z = layout.mask[:, 8:]
    assert torch.equal(to_z, torch.eye(4, dtype=torch.bool)), "each z is its own span"


def test_accepting_a_draft_follows_the_rule():
    gen = torch.Generator().manual_seed(0)
    p = torch.zeros(3, 256)
    p[:, 7] = 1.0
    r = torch.zeros(2, 256)
    r[:, 7] = 1.0
    assert accept_draft([7, 7], r, p, gen) == [7, 7, 7], "all accepted, plus a bonus byte"
    r2 = torch.zeros(2, 256)
    r2[:, 9] = 1.0
    assert accept_draft([9, 9], r2, p, gen) == [7], "rejected at once: the residual is p"


class ToyDenoiser:
    """Logits over 4 bytes that depend on the last visible clean byte and on the noisy state,
    so the sampler's law is a real mixture over sweeps and a visibility bug would show."""

    def __call__(self, b, x, z, sigma, layout):
        last = x[:, (layout.span_start - 1).clamp(min=0)]  # (N, Lz) last byte each z sees
        logits = torch.full((*last.shape, 256), -40.0)
        base = torch.stack([last % 4 == k for k in range(4)], dim=-1).float() * 1.5
        logits[..., 60:64] = base + 2.0 * z[..., :4]
        return logits


@pytest.mark.parametrize(("method", "verify_draws"), [("euler", 1), ("euler", 4), ("ancestral", 4)])
def test_draft_and_verify_emit_exactly_the_k1_samplers_law(method, verify_draws):
    """Ancestral draws fork at the last grid point (verify_fork), and M > 1 draws are
    antithetic (stratified bytes at the fork): exact all the same."""
    grid = SigmaSchedule.from_config(CFG).sampler_grid(1)
    prompt = torch.tensor([[61, 62, 63]])
    draws = 1500
    plain = generate(
        ToyDenoiser(),
        prompt.expand(draws, -1),
        2,
        grid=grid,
        targets=TARGETS,
        span=1,
        max_context=CFG.seq_len - 1,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(1),
        method=method,
    )
    # A drafter that is often wrong: it knows nothing of the toy's rules.
    drafter = NgramDrafter(
        np.frombuffer(bytes(range(60, 64)) * 40 + b"<=>?" * 7, dtype=np.uint8), order=2
    )
    gen = torch.Generator().manual_seed(2)
    spec = []
    for _ in range(draws):
        out, _ = _toy_speculative(prompt, 2, drafter, 3, gen, verify_draws, method)
        spec.append(out[0].tolist())
    a = torch.tensor([(p[0] - 60) * 4 + (p[1] - 60) for p in plain.tolist()])
    b = torch.tensor([(s[0] - 60) * 4 + (s[1] - 60) for s in spec])
    ca, cb = torch.bincount(a, minlength=16).double(), torch.bincount(b, minlength=16).double()
    # Two-sample chi-squared over the 16 outcomes of the first two bytes (15 degrees of
    # freedom): the 0.999 quantile is 37.7, so an exact method fails this one run in a
    # thousand; a law off by a few percent in any cell fails it almost surely.
    keep = (ca + cb) > 0
    chi2 = float((((ca - cb) ** 2) / (ca + cb))[keep].sum())
    assert chi2 < 37.7, f"chi2 = {chi2:.1f}: {ca.tolist()} vs {cb.tolist()}"
    assert len(set(b.tolist())) > 8, "the toy's law is spread, so the test has power"


def _toy_speculative(
    prompt,
    n_bytes: int,
    drafter,
    draft_len: int,
    gen,
    draws: int,
    method: str = "euler",
):
    """generate_speculative on the toy denoiser with one step per block."""
    return generate_speculative(
        ToyDenoiser(),
        prompt,
        n_bytes,
        drafter=drafter,
        draft_len=draft_len,
        grid=SigmaSchedule.from_config(CFG).sampler_grid(1),
        targets=TARGETS,
        seq_len=CFG.seq_len,
        sampling=Sampling(),
        generator=gen,
        draws=draws,
        method=method,
    )


def _bytes_per_traversal(
    drafter,
    draws: int,
    prompts: int = 100,
    seed: int = 3,
    method: str = "euler",
) -> float:
    gen = torch.Generator().manual_seed(seed)
    made = traversals = 0
    for _ in range(prompts):
        prompt = torch.tensor([[61, 62, 63]])
        _, loop = _toy_speculative(prompt, 12, drafter, 4, gen, draws, method)
        made, traversals = made + loop.produced, traversals + loop.traversals
    return made / traversals


def test_averaging_verify_draws_accepts_more_of_a_draft():
    """One sweep's law is a noisy estimate of the sampler's; the mean of M rows is closer, and
    the rule accepts a draft by how close the two laws are (Leviathan et al. 2023, arXiv
    2211.17192, section 3: the acceptance rate is E sum min(p, r))."""
    # The toy's law favours repeating the last byte; so does this drafter.
    runs = b"".join(bytes([b]) * 5 for b in range(60, 64)) * 20
    drafter = NgramDrafter(np.frombuffer(runs, dtype=np.uint8), order=1)
    one, eight = _bytes_per_traversal(drafter, 1), _bytes_per_traversal(drafter, 8)
    assert eight > one + 0.1, (one, eight)  # seeds 0-5: +0.18 to +0.36
    with pytest.raises(ValueError, match="verify_draws"):
        _bytes_per_traversal(drafter, 0)


def test_a_model_drafter_drafts_from_its_own_law():
    cfg = ModelConfig(d_model=16, n_heads=2, layers=1, blocks=1, seq_len=8, span=1)
    model = init_reference(cfg, seed=0)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # a law far from uniform
    drafter = ModelDrafter(model)
    context = list(b"abcdefghij")
    drafted, laws = drafter.draft(context, 3, torch.Generator().manual_seed(0))
    assert len(drafted) == 3 and laws.shape == (3, 256)
    assert torch.allclose(laws.sum(1), torch.ones(3, dtype=torch.float64))
    # Byte i is drawn given the context's last T - n bytes and the bytes drafted before it
    # (the cached passes give the full pass's law).
    window = context[-(8 - 3) :]
    with torch.no_grad():
        for i in range(3):
            full = model(torch.tensor([window + drafted[:i]]))[0, -1].double()
            assert torch.allclose(laws[i], torch.softmax(full, dim=-1), atol=1e-6), i
    assert drafter.draft(context, 0, torch.Generator())[0] == []


def test_the_draws_of_a_verify_sweep_are_independent_sweeps_sharing_the_clean_stream():
    """M draws in one sequence (verify_layout(draws=M)) give, draw by draw, the logits of M
    separate verify sweeps of the same context and draft: no draw sees another."""
    cfg = ModelConfig(d_model=32, n_heads=2, layers=4, blocks=2, seq_len=32, span=1)
    block = randomised_block(cfg)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (1, 12), generator=gen)  # 9 context bytes, 3 drafted
    z = torch.randn(1, 3 * 4, cfg.d_model, generator=gen) * 3  # 3 draws of 4 positions
    sigma = torch.full((1,), 2.5)
    together = block(x, z, sigma, verify_layout(9, 3, draws=3))[0]
    for m in range(3):
        alone = block(x, z[:, 4 * m : 4 * (m + 1)], sigma, verify_layout(9, 3))[0]
        torch.testing.assert_close(together[:, 4 * m : 4 * (m + 1)], alone, rtol=1e-4, atol=1e-5)
    layout = verify_layout(9, 3, draws=2)
    assert layout.z_pos.tolist() == [9, 10, 11, 12] * 2
    assert torch.equal(layout.mask[:, 12:], torch.eye(8, dtype=torch.bool)), "each draw alone"


def test_forked_draws_share_the_sweep_up_to_the_fork_and_part_there():
    """Ancestral draws run one copy of the tokens until the fork (the last grid point), then
    each copy draws its own state: the points before see D + 1 tokens, the last M (D + 1), and
    the copies differ."""
    grid = SigmaSchedule.from_config(CFG).sampler_grid(2)
    fork = verify_fork(len(grid), "ancestral", 3)
    assert fork == len(grid) - 1 == 5
    assert verify_fork(len(grid), "euler", 3) == verify_fork(len(grid), "ancestral", 1) == 0
    seen: list[torch.Tensor] = []

    def denoise(b, x, z, sigma, layout):
        seen.append(z.clone())
        return ToyDenoiser()(b, x, z, sigma, layout)

    x = torch.tensor([[61, 62, 63, 60, 61]])  # 3 context bytes, 2 drafted
    copies = verify_layout(3, 2, draws=3)
    logits = one_sweep(
        denoise,
        x,
        torch.randn(1, 3, 8),
        grid,
        TARGETS,
        verify_layout(3, 2),
        method="ancestral",
        generator=torch.Generator().manual_seed(0),
        fork=Fork(fork, 3, copies),
    )
    assert [z.shape[1] for z in seen] == [3] * 5 + [9] and logits.shape == (1, 9, 256)
    last = seen[-1].view(3, 3, 8)
    assert not torch.equal(last[0], last[1]) and not torch.equal(last[1], last[2])
    with pytest.raises(ValueError, match="ancestral"):
        one_sweep(
            denoise,
            x,
            torch.randn(1, 3, 8),
            grid,
            TARGETS,
            verify_layout(3, 2),
            fork=Fork(fork, 3, copies),
        )


def test_forked_draws_accept_more_of_a_draft_than_one_draw():
    """Under the ancestral sampler much of a sweep's randomness enters at its last step, so M
    copies forked there bring p_bar closer to the sampler's law than one draw does
    (bench/verify_acceptance.py compares them with M whole sweeps)."""
    runs = b"".join(bytes([b]) * 5 for b in range(60, 64)) * 20
    drafter = NgramDrafter(np.frombuffer(runs, dtype=np.uint8), order=1)
    one = _bytes_per_traversal(drafter, 1, method="ancestral")
    forked = _bytes_per_traversal(drafter, 8, method="ancestral")
    assert forked > one + 0.1, (one, forked)


def test_antithetic_noise_comes_in_pairs_and_one_copy_is_a_plain_draw():
    eps = antithetic_normal(5, (3, 4), torch.Generator().manual_seed(0))
    assert eps.shape == (5, 3, 4)
    assert torch.equal(eps[3:], -eps[:2]) and not torch.equal(eps[2], -eps[0])
    one = antithetic_normal(1, (3, 4), torch.Generator().manual_seed(0))
    assert torch.equal(one, torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0)))


def test_a_forks_copies_draw_their_bytes_stratified_and_each_byte_as_often_as_its_law():
    """Copy m inverts the law's CDF at (u + m) / M: over a uniform law on M bytes the M copies
    hold each byte once; over any law, a copy picked at random is an ancestral draw."""
    targets = torch.eye(256)  # the state reads back the byte: E[y] + 0 * eps
    logits = torch.full((2, 3, 256), -float("inf"))
    logits[..., 10:14] = 0.0  # uniform over 4 bytes at every position
    z = fork_step(logits, targets, 0.0, 4, torch.Generator().manual_seed(0))
    assert z.shape == (2, 12, 256)
    drawn = z.argmax(-1).view(2, 4, 3)  # (N, copy, position)
    assert torch.equal(drawn.sort(dim=1).values[:, :, 0], torch.arange(10, 14).expand(2, 4))
    law = torch.tensor([0.5, 0.3, 0.15, 0.05])
    skewed = torch.full((1, 1, 256), -float("inf"))
    skewed[..., 20:24] = law.log()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(2000):
        picked = fork_step(skewed, targets, 0.0, 3, gen).argmax(-1)[0] - 20  # 3 copies
        counts += torch.bincount(picked, minlength=4)
    expected = law * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (chi2, counts.tolist())  # 3 degrees of freedom, 0.999 quantile
