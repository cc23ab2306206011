"""Aggregation rules and the outer optimizer, checked against hand computations."""

from __future__ import annotations

import pytest
import torch

from blocktrain.protocol.aggregation import (
    Accumulator,
    OuterOptimizer,
    coordinate_median,
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


def test_trimmed_mean_with_nothing_to_trim_is_the_mean():
    ds = deltas(1.0, 3.0)
    assert torch.allclose(trimmed_mean(ds, 0.2)["w"], weighted_mean(ds, [1, 1])["w"])
    with pytest.raises(ValueError):
        trimmed_mean(ds, 0.5)


@pytest.mark.parametrize("rule", ["mean", "median", "trimmed_mean"])
def test_accumulator_matches_the_batch_rules(rule):
    ds = deltas(0.5, 2.0, -1.0)
    weights = [10.0, 30.0, 60.0]
    acc = Accumulator(rule, trim=0.34)
    assert acc.result() is None
    for d, w in zip(ds, weights, strict=True):
        acc.add(d, w)
    got = acc.result()
    assert got is not None
    want = {
        "mean": lambda: weighted_mean(ds, weights),
        "median": lambda: coordinate_median(ds),
        "trimmed_mean": lambda: trimmed_mean(ds, 0.34),
    }[rule]()
    for name in want:
        assert torch.allclose(got[name], want[name]), (rule, name)


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
        Accumulator("mode")
    with pytest.raises(ValueError):
        Accumulator().add(deltas(1.0)[0], 0.0)
    with pytest.raises(ValueError):
        weighted_mean([], [])
    with pytest.raises(ValueError):
        OuterOptimizer(momentum=1.0)
