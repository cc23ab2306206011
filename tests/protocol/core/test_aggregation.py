"""Aggregation rules and the outer optimizer, checked against hand computations."""

from __future__ import annotations

import pytest
import torch

from blocktrain.protocol.core.aggregation import (
    Accumulator,
    OuterOptimizer,
    Policy,
    clip_scales,
    coordinate_median,
    trim_count,
    trimmed_mean,
    weighted_mean,
)


def deltas(*values: float) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.full((2, 2), v), "b": torch.tensor([v, -v])} for v in values]


def test_token_weighted_mean():
    out = weighted_mean(deltas(1.0, 4.0), [300, 100])
    assert torch.allclose(out["w"], torch.full((2, 2), (300 * 1 + 100 * 4) / 400))
    assert torch.allclose(out["b"], torch.tensor([1.75, -1.75]))


def test_mean_is_fp32_whatever_the_input():
    half = [{k: v.half() for k, v in d.items()} for d in deltas(0.1, 0.3)]
    assert weighted_mean(half, [1, 1])["w"].dtype == torch.float32


def test_median_and_trimmed_mean_resist_an_outlier():
    ds = deltas(1.0, 1.1, 0.9, 1000.0, 1.0)
    assert torch.allclose(coordinate_median(ds)["w"], torch.full((2, 2), 1.0))
    trimmed = trimmed_mean(ds, 0.2)["w"]  # drops 0.9 and 1000 per coordinate
    assert torch.allclose(trimmed, torch.full((2, 2), (1.0 + 1.1 + 1.0) / 3))
    assert weighted_mean(ds, [1] * 5)["w"][0, 0] > 100, "the plain mean does not"


def test_trimmed_mean_trims_at_small_n_and_refuses_when_n_is_at_most_2k():
    """Finding (Poisoning): trimmed_mean at trim 0.1 trimmed nothing below 10 updates
    (floor(0.1 n) = 0). Now it trims ceil(trim n), at least f, and refuses n <= 2k."""
    ds = deltas(1.0, 1.2, 1000.0)
    assert trim_count(3, 0.1) == 1 and trim_count(9, 0.1) == 1 and trim_count(3, 0.0, 1) == 1
    assert torch.allclose(trimmed_mean(ds, 0.1)["w"], torch.full((2, 2), 1.2))
    with pytest.raises(ValueError, match="more than 2"):
        trimmed_mean(deltas(1.0, 3.0), 0.2)
    with pytest.raises(ValueError):
        trimmed_mean(ds, 0.5)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_robust_rules_commit_nothing_and_say_why_when_n_is_at_most_2f(rule):
    acc = Accumulator(Policy(rule=rule, tolerate=1, clip=0))
    for i, v in enumerate((1.0, 50.0)):
        acc.add(i, deltas(v)[0], identity=i)
    got = acc.result()
    assert got.delta is None and "needs more than 2 votes; 2 came" in got.held
    acc.add(2, deltas(1.1)[0], identity=2)
    assert acc.result().delta is not None


@pytest.mark.parametrize("rule", ["mean", "median", "trimmed_mean"])
def test_accumulator_matches_the_batch_rules(rule):
    ds = deltas(0.5, 2.0, -1.0)
    weights = [0.25, 1.0, 0.5]
    acc = Accumulator(Policy(rule=rule, trim=0.2, tolerate=0, clip=0))
    assert acc.result().delta is None
    for i, (d, w) in enumerate(zip(ds, weights, strict=True)):
        acc.add(i, d, identity=i, weight=w)
    got = acc.result().delta
    assert got is not None
    want = {
        "mean": lambda: weighted_mean(ds, weights),
        "median": lambda: coordinate_median(ds),
        "trimmed_mean": lambda: trimmed_mean(ds, 0.2),
    }[rule]()
    for name in want:
        assert torch.allclose(got[name], want[name]), (rule, name)


def test_accumulator_mean_weights_identities_by_staleness_not_claimed_tokens():
    """Finding (Poisoning): the mean was weighted by the token counts workers report."""
    acc = Accumulator(Policy(clip=0))
    acc.add(1, deltas(1.0)[0], identity="honest", tokens=100)
    acc.add(2, deltas(-5.0)[0], identity="liar", tokens=10**9)
    acc.add(3, deltas(4.0)[0], identity="late", weight=0.5, tokens=100)
    got = acc.result().delta
    assert got is not None
    assert torch.allclose(got["w"], torch.full((2, 2), (1.0 - 5.0 + 0.5 * 4.0) / 2.5))
    old = Accumulator(Policy(clip=0, weighting="reported"))
    old.add(1, deltas(1.0)[0], identity="honest", tokens=100)
    old.add(2, deltas(-5.0)[0], identity="liar", tokens=10**9)
    old_delta = old.result().delta
    assert old_delta is not None and old_delta["w"][0, 0] < -4.99, "what the liar bought"


def test_sybils_under_one_token_are_one_vote_so_the_median_holds():
    """Finding (Poisoning): median failed against 4 Sybils and 3 honest workers (50.5)."""
    acc = Accumulator(Policy(rule="median", clip=0))
    for i, v in enumerate((1.0, 1.1, 0.9)):
        acc.add(i, deltas(v)[0], identity=("token", i))
    for i in range(4):
        acc.add(10 + i, deltas(100.0)[0], identity=("token", 99))
    got = acc.result()
    assert got.votes == 4 and got.delta is not None
    assert float(got.delta["w"].max()) <= 1.1, "one Sybil vote cannot move the median far"
    per_worker = coordinate_median(deltas(1.0, 1.1, 0.9, *[100.0] * 4))["w"]
    assert torch.allclose(per_worker, torch.full((2, 2), 100.0)), "counted per worker it would"


def test_clipping_bounds_each_vote_to_c_times_the_median_norm_per_tensor():
    acc = Accumulator(Policy(clip=2.0))
    acc.add(1, {"w": torch.full((2, 2), 1.0), "b": torch.tensor([1.0, 0.0])}, identity=1)
    acc.add(2, {"w": torch.full((2, 2), 1.0), "b": torch.tensor([3.0, 0.0])}, identity=2)
    acc.add(3, {"w": torch.full((2, 2), -100.0), "b": torch.tensor([2.0, 0.0])}, identity=3)
    got = acc.result().delta
    assert got is not None
    # w: norms 2, 2, 200, median 2, so the attacker's w is scaled to norm 4, i.e. -2 each
    assert torch.allclose(got["w"], torch.full((2, 2), (1 + 1 - 2) / 3))
    # b: norms 1, 3, 2, median 2, bound 4: nothing clipped
    assert torch.allclose(got["b"], torch.tensor([2.0, 0.0]))


def test_sparse_votes_are_averaged_per_coordinate_over_the_votes_that_carry_it():
    """Two votes, one carrying a coordinate: the mean there is that vote's value (not half of
    it); where both carry one it is their weighted mean; where none does, 0. Dense votes are
    averaged as before (the same coordinate is halved)."""
    a = {"w": torch.tensor([4.0, 0.0, 2.0, 0.0])}
    b = {"w": torch.tensor([0.0, 0.0, 6.0, -1.0])}
    for per_coordinate, want in (
        (True, [4.0, 0.0, (2.0 + 3 * 6.0) / 4, -1.0]),
        (False, [1.0, 0.0, (2.0 + 3 * 6.0) / 4, -0.75]),
    ):
        acc = Accumulator(Policy(clip=0), per_coordinate=per_coordinate)
        acc.add(1, a, identity="a", weight=1.0)
        acc.add(2, b, identity="b", weight=3.0)
        got = acc.result().delta
        assert got is not None
        assert torch.allclose(got["w"], torch.tensor(want)), (per_coordinate, got["w"])
    # an identity's several updates are averaged into its vote the same way
    acc = Accumulator(Policy(clip=0), per_coordinate=True)
    acc.add(1, a, identity="t")
    acc.add(2, b, identity="t")
    got = acc.result().delta
    assert got is not None and torch.allclose(got["w"], torch.tensor([4.0, 0.0, 4.0, -1.0]))


def test_the_per_coordinate_mean_comes_after_clipping():
    """Clipping scales each vote as for any delta; the carrying votes' weight divides after."""
    votes = [
        {"w": torch.tensor([1.0, 0.0])},
        {"w": torch.tensor([0.0, 1.0])},
        {"w": torch.tensor([100.0, 0.0])},  # norm 100, median 1, bound 2: scaled by 0.02
    ]
    acc = Accumulator(Policy(clip=2.0), per_coordinate=True)
    for i, v in enumerate(votes):
        acc.add(i, v, identity=i)
    got = acc.result().delta
    assert got is not None
    assert torch.allclose(got["w"], torch.tensor([(1.0 + 2.0) / 2, 1.0]))
    scales = clip_scales(votes, 2.0)
    direct = weighted_mean(votes, [1, 1, 1], scales, per_coordinate=True)
    assert torch.allclose(direct["w"], got["w"])


def test_centered_clip_resists_an_outlier_and_keeps_agreeing_votes():
    acc = Accumulator(Policy(rule="centered_clip", clip=0))
    for i, v in enumerate((1.0, 1.0, 1.0, 1000.0)):
        acc.add(i, deltas(v)[0], identity=i)
    got = acc.result().delta
    assert got is not None and torch.allclose(got["w"], torch.full((2, 2), 1.0))


def test_discard_removes_updates_by_id():
    acc = Accumulator(Policy(clip=0))
    acc.add(7, deltas(1.0)[0], identity=1)
    acc.add(8, deltas(3.0)[0], identity=2)
    assert acc.discard([8, 99]) == [8] and acc.count == 1
    got = acc.result().delta
    assert got is not None and torch.allclose(got["w"], torch.full((2, 2), 1.0))
    with pytest.raises(ValueError):
        acc.add(7, deltas(1.0)[0], identity=1)


def test_plain_outer_step_adds_the_delta():
    weights = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    new, buf = OuterOptimizer().apply(weights, deltas(0.5)[0])
    assert buf is None
    assert torch.allclose(new["w"], torch.full((2, 2), 1.5))
    assert torch.equal(weights["w"], torch.ones(2, 2)), "inputs are not modified"


def test_outer_nesterov_matches_the_diloco_update():
    opt = OuterOptimizer(lr=0.7, momentum=0.9)
    theta = {"w": torch.tensor([1.0])}
    m = None
    manual_theta, manual_m = 1.0, 0.0
    for d in (0.2, -0.1, 0.3):
        theta, m = opt.apply(theta, {"w": torch.tensor([d])}, m)
        g = -d
        manual_m = 0.9 * manual_m + g
        manual_theta -= 0.7 * (g + 0.9 * manual_m)
        assert m is not None
        assert theta["w"].item() == pytest.approx(manual_theta, rel=1e-6)
        assert m["w"].item() == pytest.approx(manual_m, rel=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError):
        Accumulator(Policy(rule="mode"))
    with pytest.raises(ValueError):
        Accumulator(Policy(weighting="tokens"))
    with pytest.raises(ValueError):
        Accumulator().add(1, deltas(1.0)[0], identity=1, weight=0.0)
    with pytest.raises(ValueError):
        weighted_mean([], [])
    with pytest.raises(ValueError):
        OuterOptimizer(momentum=1.0)
