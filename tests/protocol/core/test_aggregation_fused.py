"""The mean with clipping folds the clip factors into the weighted sum (no scaled fp32 copy of
each vote): it equals clipping the votes first and then averaging them."""

from __future__ import annotations

import torch

from blocktrain.protocol.core.aggregation import Accumulator, Policy, clip_to_median, weighted_mean


def test_folded_clipping_equals_clipping_first():
    gen = torch.Generator().manual_seed(0)
    votes = [
        {
            "w": (torch.randn(64, 32, generator=gen) * (1 + 9 * (i == 3))).half(),
            "b": torch.randn(32, generator=gen).half() * (0.1 if i == 1 else 1.0),
        }
        for i in range(7)
    ]
    weights = [1.0, 0.5, 1.0, 1.0, 0.25, 1.0, 1.0]
    acc = Accumulator(Policy(rule="mean", clip=2.0))
    for i, (v, w) in enumerate(zip(votes, weights, strict=True)):
        acc.add(i, v, identity=i, weight=w)
    got = acc.result().delta
    assert got is not None
    want = weighted_mean(clip_to_median(votes, 2.0), weights)
    unclipped = weighted_mean(votes, weights)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    # vote 3 is ten times larger: clipping moves the mean far more than the tolerance above
    assert float((unclipped["w"] - want["w"]).abs().max()) > 0.1
