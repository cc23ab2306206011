"""The influence bound (docs/protocol.md, Aggregation): under `mean` no identity's term in a
round's aggregate exceeds max_influence x the median of the block's recent changes, whatever
its norm, weight or the round's majority."""

from __future__ import annotations

import math

import pytest
import torch

from blocktrain.protocol.core.aggregation import Accumulator, Policy
from blocktrain.protocol.core.influence import (
    INFLUENCE_GROWTH,
    INFLUENCE_WINDOW,
    InfluenceHistory,
    influence_scales,
    norms,
    term_norms,
)
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.settings import AggregatorSettings
from tests.protocol.conftest import block_tensors, delta_body

F = 0.5
SHAPES = {k: v.shape for k, v in block_tensors(0).items()}
TOL = 1e-4  # relative: fp32 sums over a few votes


def vote(gen: torch.Generator, mean: float = 0.1, noise: float = 0.1) -> dict[str, torch.Tensor]:
    return {k: mean + noise * torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def history(norm: float = 1.0) -> InfluenceHistory:
    h = InfluenceHistory()
    for _ in range(INFLUENCE_WINDOW):
        h = h.add({k: norm for k in SHAPES})
    return h


def aggregate(votes, weights, reference, per_coordinate=False, rule="mean"):
    acc = Accumulator(Policy(rule=rule, max_influence=F), per_coordinate=per_coordinate)
    for i, (v, w) in enumerate(zip(votes, weights, strict=True)):
        acc.add(i, v, identity=("token", i), weight=w)
    return acc.result(reference)


def test_the_reference_is_the_median_of_the_last_window_and_grows_at_most_by_the_cap():
    h = InfluenceHistory()
    for i in range(INFLUENCE_WINDOW - 1):
        h = h.add({"w": float(i + 1)})
        assert h.reference() is None, "fewer than the window: clip and the norm bound alone"
    h = h.add({"w": 8.0})
    assert h.reference() == {"w": 4.5}
    h = h.add({"w": 1e9})  # a huge round is recorded as at most GROWTH x the reference
    assert h.recent[-1]["w"] == pytest.approx(INFLUENCE_GROWTH * 4.5)
    for _ in range(100):  # votes at the edge every round: the reference grows, but slowly
        ref = h.reference()
        assert ref is not None
        before = ref["w"]
        h = h.add({"w": 1e9})
        assert h.reference()["w"] <= INFLUENCE_GROWTH * before * (1 + 1e-12)


@pytest.mark.parametrize("norm", [1e-3, 1.0, 1e3, 1e9])
@pytest.mark.parametrize("honest_weight", [1.0, 0.1])
def test_one_identity_at_any_norm_moves_the_mean_by_at_most_f_of_the_reference(
    norm: float, honest_weight: float
) -> None:
    """The committed change is (1 - share) x the others' mean + the identity's term (share:
    its weight over the round's), and the term is at most f x R in every tensor: at any norm, and with a share of 0.7 when the honest
    identities' reputation is 0.1."""
    gen = torch.Generator().manual_seed(1)
    honest = [vote(gen) for _ in range(4)]
    direction = vote(gen, mean=0.0, noise=1.0)
    scale = norm / math.sqrt(sum(float(t.pow(2).sum()) for t in direction.values()))
    evil = {k: scale * t for k, t in direction.items()}
    ref = history(0.4).reference()
    assert ref is not None
    weights = [honest_weight] * 4 + [1.0]
    with_it = aggregate([*honest, evil], weights, ref).delta
    assert with_it is not None
    for k in SHAPES:
        others = sum(w * h[k] for w, h in zip(weights[:4], honest, strict=True)) / sum(weights)
        moved = float((with_it[k] - others).norm())
        assert moved <= F * ref[k] * (1 + TOL), (k, norm, moved)


def test_a_hostile_majority_gets_f_of_the_reference_per_identity_whatever_the_median():
    """Three identities of huge votes and two honest: today's clip follows their median, the
    influence bound does not."""
    gen = torch.Generator().manual_seed(2)
    honest = [vote(gen) for _ in range(2)]
    evil = [{k: torch.full(s, 100.0) for k, s in SHAPES.items()} for _ in range(3)]
    ref = history(0.4).reference()
    assert ref is not None
    votes, weights = [*honest, *evil], [1.0] * 5
    terms = term_norms(votes, weights)
    capped = influence_scales(terms, ref, F)
    assert capped is not None
    for t, c in zip(terms, capped, strict=True):
        for k in SHAPES:
            assert t[k] * c[k] <= F * ref[k] * (1 + TOL), k
    result = aggregate(votes, weights, ref).delta
    assert result is not None
    for k in SHAPES:
        honest_part = sum(h[k] for h in honest) / 5
        assert float((result[k] - honest_part).norm()) <= 3 * F * ref[k] * (1 + TOL), k
    unbounded = aggregate(votes, weights, None).delta
    assert unbounded is not None
    assert float(unbounded["embed"].norm()) > 100 * ref["embed"], "without it they own the mean"


def test_sparse_votes_bound_the_share_of_the_coordinates_one_vote_carries_alone():
    gen = torch.Generator().manual_seed(3)
    honest = []
    for _ in range(3):
        v = vote(gen)
        v["embed"][:, 2:] = 0  # the honest votes never carry these coordinates
        honest.append(v)
    evil = {k: torch.zeros(s) for k, s in SHAPES.items()}
    evil["embed"][:, 2:] = 1e6  # alone there: its share is 1, not 1/4
    ref = history(0.4).reference()
    assert ref is not None
    result = aggregate([*honest, evil], [1.0] * 4, ref, per_coordinate=True).delta
    assert result is not None
    assert float(result["embed"][:, 2:].norm()) <= F * ref["embed"] * (1 + TOL)


def test_no_cut_below_the_bound_and_none_for_the_order_statistic_rules():
    gen = torch.Generator().manual_seed(4)
    votes = [vote(gen) for _ in range(5)]
    big = history(100.0).reference()
    for rule in ("mean", "median", "trimmed_mean", "centered_clip"):
        bounded = aggregate(votes, [1.0] * 5, big, rule=rule)
        plain = aggregate(votes, [1.0] * 5, None, rule=rule)
        assert bounded.delta is not None and plain.delta is not None
        for k in SHAPES:
            assert torch.equal(bounded.delta[k], plain.delta[k]), (rule, k)
        assert bounded.uncapped == norms(plain.delta)
    tiny = history(1e-6).reference()
    for rule in ("median", "trimmed_mean", "centered_clip"):  # mean only (docs: which rules)
        bounded = aggregate(votes, [1.0] * 5, tiny, rule=rule).delta
        plain = aggregate(votes, [1.0] * 5, None, rule=rule).delta
        assert bounded is not None and plain is not None
        assert all(torch.equal(bounded[k], plain[k]) for k in SHAPES), rule


# ---------------------------------------------------------------- in the engine, round by round

SETTINGS = AggregatorSettings(
    deadline_s=30.0,
    max_delta_norm=1e12,
    max_tokens=10**12,
    wire_dtype="fp32",
    min_round_s=0.0,
    effect_probe="off",
    max_influence=F,
    drift_threshold=0.0,
)


def play(eng: RoundEngine, workers: list[int], votes: list[dict[str, torch.Tensor]], now: float):
    """One round: every worker pulls, then pushes its vote; the round closes when all did."""
    views = [eng.pull(w, 0, now).view for w in workers]
    for w, v, view in zip(workers, votes, views, strict=True):
        body = delta_body(0, tensors=v, round=view.round, base_version=view.version, dtype="fp32")
        checked = eng.check(0, body, w)
        assert checked.verdict.accepted and checked.meta is not None, checked.verdict
        verdict = eng.judge(w, 0, checked.meta, now)
        assert verdict.accepted, verdict
        eng.record(w, 0, verdict, now, checked=checked)
    eng.tick(now)


def test_in_any_round_one_identity_moves_the_committed_block_by_at_most_f_of_recent_changes():
    base = {k: torch.zeros(s) for k, s in SHAPES.items()}
    eng = RoundEngine.fresh({0: base}, SETTINGS)
    workers = [eng.register(0.0, 0, lambda _b, i=i: i, i).worker for i in range(5)]
    gen = torch.Generator().manual_seed(5)
    now = 1.0
    for r in range(INFLUENCE_WINDOW + 6):
        before = eng.blocks[0].weights
        ref = eng.blocks[0].influence.reference()
        honest = [vote(gen) for _ in range(4)]
        evil = {k: 10.0 ** (r % 7) * torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        play(eng, workers, [*honest, evil], now)
        now += 1.0
        if ref is None:
            continue
        after = eng.blocks[0].weights
        for k in SHAPES:
            change = after[k] - before[k]
            honest_mean = sum(h[k] for h in honest) / 4
            term = change - 0.8 * honest_mean  # (1 - share) x the others' mean, share 1/5
            assert float(term.norm()) <= F * ref[k] * (1 + TOL), (r, k)


def test_a_lone_identity_keeps_moving_its_block():
    """A reference fed by the cut steps would shrink a lone identity's changes by f each
    window, to nothing; fed by the uncut aggregate it keeps them at f x its own pace."""
    base = {k: torch.zeros(s) for k, s in SHAPES.items()}
    eng = RoundEngine.fresh({0: base}, SETTINGS)
    (worker,) = [eng.register(0.0, 0, lambda _b: 0, 0).worker]
    gen = torch.Generator().manual_seed(6)
    for r in range(40):
        before = eng.blocks[0].weights
        v = vote(gen, mean=0.0, noise=1.0)
        play(eng, [worker], [v], 1.0 + r)
        moved = sum(float((eng.blocks[0].weights[k] - before[k]).pow(2).sum()) for k in SHAPES)
        full = sum(float(t.pow(2).sum()) for t in v.values())
        assert math.sqrt(moved / full) >= 0.8 * F, f"round {r}: the block starves"
