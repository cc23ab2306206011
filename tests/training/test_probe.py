"""The aggregator's effect probe: deterministic, and it tells a trained update from a forged one."""

from __future__ import annotations

import torch

from blocktrain.data import ByteCorpus
from blocktrain.protocol.core.effect import Effect, judge_effect
from blocktrain.training.local import LocalBlockTrainer, initial_blocks
from blocktrain.training.probe import BlockProbe
from tests.conftest import micro_config


def test_the_probe_is_deterministic_and_judges_updates_by_their_effect(corpus):
    """Finding (Poisoning): an update was judged by its shape and norm only, so a forged one
    at the bound was accepted. The probe reads what an update does to the block's loss."""
    cfg = micro_config()
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
    flipped = {k: w - honest[k] for k, w in initial[block].items()}  # the update reversed
    after = probe.loss(block, flipped, upstream)
    assert not judge_effect(Effect(before, after), 0.002).accepted
    assert judge_effect(Effect(before, probe.loss(block, moved, upstream)), 0.002).accepted


def test_the_probe_slice_is_disjoint_from_the_evaluation_windows(corpus):
    cfg = micro_config()
    valid = ByteCorpus.open(corpus).split("valid")
    probe = BlockProbe(cfg, valid, windows=4, skip_bytes=128)
    evaluated = valid.windows(cfg.model.seq_len, 128)
    assert torch.equal(probe.x, valid.windows(cfg.model.seq_len, 128 + 4 * 16)[len(evaluated) :])
