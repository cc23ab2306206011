"""Issue 58, end to end on real training: honest replicas of a short run pass the replay screen
and the effect probe's gain test under the defaults; near-copies of their deltas are refused
`replay` or `copy`, and zero-mean noise at any share of the norm bound `no_gain` or
`harmful`, on block 0 and on the last block, without a rise in reputation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from blocktrain.data import ByteCorpus
from blocktrain.protocol.core.bodies import encode
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.simulate.aggregator import SimAggregator
from blocktrain.simulate.attacks.forge import AT_BOUND
from blocktrain.training.local import LocalBlockTrainer, initial_blocks
from blocktrain.training.probe import BlockProbe
from tests.conftest import micro_config

H = 6
CFG = micro_config("features")  # a block reads the committed blocks before it: no streams
LAST = CFG.model.blocks - 1
Tensors = dict[str, torch.Tensor]


def trained(corpus: Path, block: int, weights: dict[int, Tensors], seed: int) -> Tensors:
    """An honest replica's delta: H steps from the block's weights on its own data seed."""
    train = ByteCorpus.open(corpus).split("train")
    trainer = LocalBlockTrainer(CFG, block, train, data_seed=seed)
    trainer.load(weights[block])
    trainer.load_upstream({b: weights[b] for b in range(block)})
    trainer.train(H, first_step=0)
    return trainer.delta()


def noise(like: Tensors, norm: float, seed: int) -> Tensors:
    gen = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(v.shape, generator=gen) for k, v in like.items()}
    scale = norm / math.sqrt(sum(float(t.square().sum()) for t in out.values()))
    return {k: scale * t for k, t in out.items()}


class Block:
    """One block of a `SimAggregator` under the default settings (its effect probe on a secret
    slice), with identities that push bodies for its open round."""

    def __init__(self, corpus: Path, block: int) -> None:
        initial = initial_blocks(CFG)
        self.settings = derived_settings(CFG, {"local_steps": H}, largest_block(initial))
        probe = BlockProbe(CFG, ByteCorpus.open(corpus).split("valid"), secret=7)
        self.sim = SimAggregator(initial, self.settings, probe, seed=0)
        self.block, self.now = block, 0.0

    def join(self, token: int) -> int:
        worker, _ = self.sim.register(self.now, self.block, token)
        return worker

    def push(self, worker: int, delta: Tensors) -> str:
        """Pull the open round and push `delta` for it; the verdict's reason ("" accepted)."""
        view, _, _, _ = self.sim.pull(worker, self.block, self.now)
        meta = {
            "block": self.block,
            "base_version": view.version,
            "round": view.round,
            "tokens": H * CFG.train.batch_size * CFG.model.seq_len,
            "worker_id": worker,
        }
        body = encode(delta, meta, self.settings.wire_dtype)
        return self.sim.push(worker, self.block, body, self.now).verdict.reason

    def reputation(self, token: int) -> float:
        return self.sim.engine.reputation.of(("token", token))

    def close(self) -> None:
        self.now += self.settings.deadline_s
        self.sim.tick(self.now)


@pytest.mark.parametrize("block", [0, LAST])
def test_honest_replicas_pass_and_noise_at_any_share_of_the_bound_does_not(corpus, block):
    """Finding (issue 58): Gaussian noise with no training behind it was accepted on block 0
    at 0.08 and 0.63 of the norm bound, and raised its token's reputation. Its windows' changes
    read up to 2.2 standard errors of fall here (the paired test accepts below +1): the gain
    test reads its direction against what its magnitudes gain by chance."""
    b = Block(corpus, block)
    weights = {k: st.weights for k, st in b.sim.blocks.items()}
    honest = [b.join(token) for token in (1, 2)]
    noisy = {(share, seed): b.join(10 + i) for i, (share, seed) in enumerate(
        (share, seed) for share in (0.1, 0.5, 1.0) for seed in range(3)
    )}  # fmt: skip
    for worker in noisy.values():  # a standing that an acceptance would raise
        b.sim.engine.reputation.scores[b.sim.engine.registry.identity(worker)] = 0.5
    for (share, seed), worker in noisy.items():
        size = share * AT_BOUND * b.settings.max_delta_norm  # inside the bound in fp16 too
        own = int(10 * share) + 10 * seed + 100 * block  # a direction of its own: scaled, a copy
        delta = noise(weights[block], size, own)
        reason = b.push(worker, delta)
        assert reason in ("no_gain", "harmful"), (share, seed, reason)
        identity = b.sim.engine.registry.identity(worker)
        expected = 0.25 if reason == "harmful" else 0.5
        assert b.sim.engine.reputation.of(identity) == expected, "no rise for a refusal"
    for seed, worker in enumerate(honest):
        assert b.push(worker, trained(corpus, block, weights, seed)) == "", seed
    b.close()
    assert b.sim.blocks[block].rounds.version == 1, "the honest updates committed"


def test_near_copies_of_honest_deltas_are_refused_and_honest_replicas_are_not(corpus):
    """Finding (issue 58): the replay check compared exact digests, so the same tensors with
    one fp16 value moved by one ulp were accepted again, re-stamped into a later round, and as
    a second token's vote in the same round, with weight 1.0."""
    b = Block(corpus, 0)
    weights = {k: st.weights for k, st in b.sim.blocks.items()}
    alice, bob, eve = b.join(1), b.join(2), b.join(3)
    mine, theirs = (trained(corpus, 0, weights, seed) for seed in (0, 1))
    assert b.push(alice, mine) == ""
    b.sim.engine.reputation.scores[("token", 3)] = 0.5
    ulp = {k: v.half().clone() for k, v in mine.items()}
    ulp[sorted(ulp)[0]].view(-1).view(torch.int16)[0] += 1
    assert b.push(eve, ulp) == "copy", "another token's near-copy in the same round"
    assert b.reputation(3) == 0.5, "a refusal earns nothing"
    assert b.push(bob, theirs) == "", "an honest replica trained on other data"
    b.close()
    assert b.sim.blocks[0].rounds.version == 1
    jitter = noise(mine, 1e-3 * math.sqrt(sum(float(t.square().sum()) for t in mine.values())), 5)
    again = {k: v + jitter[k] for k, v in mine.items()}
    for copy in (ulp, again):
        worker = b.join(1)  # a refusal is a report: the token comes back with a new worker
        assert b.push(worker, copy) == "replay", "its own accepted delta, one round later"
    now = {k: st.weights for k, st in b.sim.blocks.items()}
    assert b.push(b.join(2), trained(corpus, 0, now, 2)) == "", "its next honest delta"
