"""The aggregator's effect probe: deterministic, and it tells a trained update from a forged one."""

from __future__ import annotations

import pytest
import torch

from blocktrain.data import ByteCorpus
from blocktrain.protocol.core.effect import Effect, judge_effect
from blocktrain.training.local import LocalBlockTrainer, initial_blocks
from blocktrain.training.probe import BlockProbe
from tests.conftest import micro_config


def test_the_probe_is_deterministic_and_judges_updates_by_their_effect(corpus):
    """Finding (Poisoning): an update was judged by its shape and norm only, so a forged one
    at the bound was accepted. The probe reads what an update does to the block's loss."""
    cfg = micro_config("features")  # block 1 reads block 0 committed
    splits = ByteCorpus.open(corpus)
    probe = BlockProbe(cfg, splits.split("valid"), windows=8, skip_bytes=64)
    assert probe.x.shape == (8, cfg.model.seq_len)
    initial = initial_blocks(cfg)
    block = 1
    upstream = {0: initial[0]}  # route = features: block 1 reads block 0's committed version
    before = probe.loss(block, initial[block], upstream)
    assert probe.loss(block, initial[block], upstream) == before, "same weights, slice, noise"
    trainer = LocalBlockTrainer(cfg, block, splits.split("train"), data_seed=0)
    trainer.load(initial[block])
    trainer.load_upstream(upstream)
    trainer.train(6, first_step=0)
    honest = trainer.delta()
    moved = {k: w + honest[k] for k, w in initial[block].items()}
    assert probe.loss(block, moved, upstream) < before, "six honest steps lower the held-out loss"
    rows = probe.window_losses(block, initial[block], upstream)
    gradient = probe.gradient(block, initial[block], upstream)

    def verdict(delta: dict[str, torch.Tensor]) -> bool:
        after = {k: w + delta[k] for k, w in initial[block].items()}
        effect = Effect.read(rows, probe.window_losses(block, after, upstream), gradient, delta, 1)
        return judge_effect(effect, 0.002, None, 1.0, 6.0).accepted

    assert not verdict({k: -v for k, v in honest.items()}), "the update reversed"
    assert verdict(honest)


def test_the_gradient_is_that_of_the_slices_mean_loss(corpus):
    """The gain test reads g . delta as the first-order change of the probe's loss: a central
    difference along a random direction agrees (to float32 and second order in eps)."""
    cfg = micro_config("features")
    probe = BlockProbe(cfg, ByteCorpus.open(corpus).split("valid"), windows=4, skip_bytes=64)
    initial = initial_blocks(cfg)
    upstream = {0: initial[0]}
    gradient = probe.gradient(1, initial[1], upstream)
    assert set(gradient) == set(initial[1])
    gen = torch.Generator().manual_seed(0)
    direction = {k: torch.randn(v.shape, generator=gen) for k, v in initial[1].items()}
    eps = 1e-3

    def at(sign: float) -> float:
        moved = {k: w + sign * eps * direction[k] for k, w in initial[1].items()}
        return probe.loss(1, moved, upstream)

    slope = (at(1) - at(-1)) / (2 * eps)
    dot = sum(float((gradient[k] * direction[k]).sum()) for k in direction)
    assert slope == pytest.approx(dot, rel=0.02), (slope, dot)


def test_the_probe_slice_is_disjoint_from_the_evaluation_windows(corpus):
    cfg = micro_config()
    valid = ByteCorpus.open(corpus).split("valid")
    probe = BlockProbe(cfg, valid, windows=4, skip_bytes=128)
    evaluated = valid.windows(cfg.model.seq_len, 128)
    assert torch.equal(probe.x, valid.windows(cfg.model.seq_len, 128 + 4 * 16)[len(evaluated) :])


def test_window_losses_average_to_the_loss_and_a_secret_draws_a_new_slice_per_draw(corpus):
    """Finding (issue 31): the probe's slice and noise were public and fixed, so anyone could
    rebuild it and tune an update to pass it. With a secret, each draw (a committed version)
    picks its windows and noise from the secret; one draw is the same on every call, so
    before and after are read on the same windows (the paired test)."""
    cfg = micro_config()
    valid = ByteCorpus.open(corpus).split("valid")
    weights = initial_blocks(cfg)[0]
    public = BlockProbe(cfg, valid, windows=4, skip_bytes=64)
    rows = public.window_losses(0, weights)
    assert rows.shape == (4,)
    assert float(rows.mean()) == public.loss(0, weights)
    assert torch.equal(public.window_losses(0, weights, draw=5), rows), "no secret: one slice"
    secret = BlockProbe(cfg, valid, windows=4, skip_bytes=64, secret=12345)
    assert len(secret.pool) > 4, "a pool to draw from"
    first = secret.window_losses(0, weights, draw=0)
    assert torch.equal(secret.window_losses(0, weights, draw=0), first), "one draw, one slice"
    assert not torch.equal(secret.window_losses(0, weights, draw=1), first)
    other = BlockProbe(cfg, valid, windows=4, skip_bytes=64, secret=54321)
    assert not torch.equal(other.window_losses(0, weights, draw=0), first), "the secret decides"


def test_a_secret_pool_lies_away_from_the_public_slice_an_attacker_can_fit(corpus):
    """Finding (issue 31, ascend at small: 4 of 10 crafted updates passed, each raising the
    training text's loss at the probe's step): the secret pool was the 256 windows that begin
    with the public slice, one stretch of text, so an attacker fitting the public slice also
    fitted the articles every secret draw came from (the likely reason). A secret pool's
    windows now lie at secret places after the public slice, none of them in it."""
    cfg = micro_config()
    valid = ByteCorpus.open(corpus).split("valid")
    t, skip = cfg.model.seq_len, 64
    public = BlockProbe(cfg, valid, windows=4, skip_bytes=skip)
    secret = BlockProbe(cfg, valid, windows=4, skip_bytes=skip, secret=12345)
    rows = valid.windows(t, len(valid))
    first = -(-skip // t) + 4  # the index of the first window after the public slice
    assert len(rows) > first + 8 * 4 * 2, "a split with room to spread over"
    index = {tuple(r.tolist()): i for i, r in enumerate(rows)}
    where = sorted(index[tuple(r.tolist())] for r in secret.pool)
    assert len(where) == 8 * 4 and where[0] >= first, "none in the public slice or before it"
    assert where[-1] - where[0] > len(where) - 1, "not one stretch of text"
    assert torch.equal(secret.x, public.x), "the public slice is what an attacker rebuilds"
    for draw in range(4):
        x, _ = secret._slice(0, draw)
        assert not any(tuple(r.tolist()) in {tuple(p.tolist()) for p in public.x} for r in x)
