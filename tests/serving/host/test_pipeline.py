"""The reference split into KV-cached stages computes what the whole reference computes."""

from __future__ import annotations

import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.model import init_reference
from blocktrain.model.cached import KVCache
from blocktrain.model.pipeline import ReferenceStage, split_reference, stage_layers

CFG = ModelConfig(d_model=32, n_heads=2, layers=6, blocks=3, seq_len=16, span=2)


@pytest.fixture(scope="module")
def reference():
    ref = init_reference(CFG, 0).eval()
    with torch.no_grad():  # a non-zero head, so that the logits depend on everything
        torch.nn.init.normal_(ref.head.weight, std=0.5)
    return ref


def test_stages_hold_disjoint_layers_and_only_their_ends():
    assert [list(stage_layers(CFG, s, 3)) for s in range(3)] == [[0, 1], [2, 3], [4, 5]]
    first, middle, last = (ReferenceStage(CFG, s, 3) for s in range(3))
    assert first.embed is not None and first.head is None
    assert middle.embed is None and middle.head is None and middle.norm is None
    assert last.head is not None and last.embed is None
    assert {k.split(".")[1] for k in middle.state_dict()} == {"2", "3"}
    assert set(middle.state_dict()) == {
        k for k in init_reference(CFG, 0).state_dict() if k.startswith(("layers.2.", "layers.3."))
    }
    with pytest.raises(ValueError):
        stage_layers(CFG, 0, 4)


@torch.no_grad()
def test_chained_stages_equal_the_reference_exactly(reference):
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    h = x
    for stage in split_reference(reference, 3):
        h = stage(h)
    # The same layer code (DualStreamLayer.attend_clean, mlp_clean) on the same shapes: exact.
    assert torch.equal(h, reference(x))


@torch.no_grad()
def test_kv_cached_steps_match_the_full_forward(reference):
    x = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(1))
    full = reference(x)  # (2, 14, 256)
    stages = split_reference(reference, 3)
    caches = [KVCache() for _ in stages]
    outs = []
    for lo, hi in [(0, 5), (5, 6), (6, 7), (7, 11), (11, 12), (12, 14)]:
        h = x[:, lo:hi]
        for stage, cache in zip(stages, caches, strict=True):
            h = stage(h, cache)
        outs.append(h)
    # A 5-token prefill and a 14-token forward have different shapes, so the matmul kernels may
    # block them differently (AVX2 and AVX-512 do): equal up to fp32 rounding, not bitwise.
    # Logits here are O(1..10); 1e-5 is ~100 ulps of fp32 at that scale.
    torch.testing.assert_close(outs[0], full[:, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)
    # ...and a wrong cache would be far off: the same steps without the cache disagree.
    h = x[:, 12:14]
    for stage in stages:
        h = stage(h)
    assert (h - full[:, 12:14]).abs().max() > 1e-2
    assert all(c.length == 14 for c in caches)
    assert caches[0].nbytes() == 2 * 2 * 2 * 14 * 32 * 4  # k, v x 2 layers x N x P x d x fp32
