"""The replay screen's sketches (issue 58): a count sketch of a delta's direction, from a
secret, that puts a near-copy near its original and honest replicas far apart."""

from __future__ import annotations

import pytest
import torch

from blocktrain.protocol.core.replays import SKETCH_DIMS, Sketcher, distance


def delta(seed: int, n: int = 50_000) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(n, generator=gen), "a.bias": torch.randn(64, generator=gen)}


def apart(sketcher: Sketcher, x: dict, y: dict) -> float:
    sx, sy = sketcher.sketch(x), sketcher.sketch(y)
    assert sx is not None and sy is not None
    return float(distance(sx.unsqueeze(0), sy)[0])


def test_a_sketch_reads_the_distance_between_directions():
    s = Sketcher(seed=1)
    x = delta(0)
    sketch = s.sketch(x)
    assert sketch is not None and sketch.shape == (SKETCH_DIMS,)
    assert float(sketch.norm()) == pytest.approx(1.0, abs=1e-6)
    assert apart(s, x, x) == 0.0, "exactly 0 for the same tensors (copy_distance 0 holds)"
    assert apart(s, x, {k: 3 * v for k, v in x.items()}) < 1e-6, "a rescaled copy"
    half = {k: v.half() for k, v in x.items()}
    half["a.weight"].view(torch.int16)[0] += 1
    assert apart(s, {k: v.half() for k, v in x.items()}, half) < 1e-4, "one ulp moved"
    noise = delta(1)
    share = (
        1e-3
        * float(torch.cat([v for v in x.values()]).norm())
        / float(torch.cat([v for v in noise.values()]).norm())
    )
    noisy = {k: v + share * noise[k] for k, v in x.items()}
    assert apart(s, x, noisy) == pytest.approx(1e-3, rel=0.3), "noise of 1e-3 of the norm"
    assert apart(s, x, delta(2)) == pytest.approx(2**0.5, rel=0.15), "independent directions"


def test_zeros_have_no_sketch_and_the_secret_decides_the_buckets():
    s = Sketcher(seed=1)
    assert s.sketch({k: torch.zeros_like(v) for k, v in delta(0).items()}) is None
    one, other = s.sketch(delta(0)), Sketcher(seed=2).sketch(delta(0))
    assert one is not None and other is not None
    assert float(distance(one.unsqueeze(0), other)[0]) > 1.0, "another secret, other buckets"
    renamed = {f"block1.{k}": v for k, v in delta(0).items()}
    assert apart(s, delta(0), renamed) > 1.0, "buckets follow a tensor's name and size"


def test_seen_bodies_keep_the_newest_and_find_them_across_their_matrix_growing(monkeypatch):
    from blocktrain.protocol.core import replays

    monkeypatch.setattr(replays, "REPLAY_ENTRIES", 100)
    gen = torch.Generator().manual_seed(5)
    sketches = [
        torch.nn.functional.normalize(torch.randn(SKETCH_DIMS, generator=gen), dim=0)
        for _ in range(250)
    ]
    seen = replays.SeenBodies()
    for i, s in enumerate(sketches):  # past 64 rows, 128, then compacted as the oldest go
        seen.add(replays.Seen(identity=i, round=i // 10, accepted=True, sketch=s))
        assert [e.identity for e in seen] == list(range(max(0, i - 99), i + 1))
        for j in {i, max(0, i - 99), (i + max(0, i - 99)) // 2}:
            found = seen.within(sketches[j], 1e-6)
            assert [(gap, e.identity) for gap, e in found] == [(0.0, j)], (i, j)
    assert seen.within(sketches[149], 1e-6) == [], "dropped: the oldest go first"
    kept = seen.since(20)
    assert [e.identity for e in kept] == list(range(200, 250))
    assert [e.identity for _, e in kept.within(sketches[230], 1e-6)] == [230]
    assert replays.SeenBodies().within(sketches[0], 1.0) == []
