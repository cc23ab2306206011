"""Adaptive pacing in the round engine (issue 30): a pull tells each worker the local steps that
fit in the round's deadline at its measured pace, and an update may not claim more."""

from __future__ import annotations

from collections import deque

import pytest

from blocktrain.protocol.core.pacing import Pacer, fewest_steps, fit_steps, steps_share
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.validation import UpdateMeta
from blocktrain.protocol.core.verdict import Verdict
from tests.protocol.conftest import block_tensors, delta_body

BASE = block_tensors(100)
ADAPTIVE = AggregatorSettings(
    deadline_s=30.0,
    local_steps=10,
    pacing="adaptive",
    max_delta_norm=1e4,
    max_tokens=10**6,
    quorum=1.0,
    min_round_s=0.0,
    replay_rounds=0,
    effect_probe="off",
)


def engine(settings: AggregatorSettings = ADAPTIVE) -> tuple[RoundEngine, list[int]]:
    """One block, two workers: 0 (fast) and 1 (slow)."""
    eng = RoundEngine.fresh({0: BASE}, settings)
    ids = iter(range(10))
    workers = [eng.register(0.0, 0, lambda _b: next(ids)).worker for _ in range(2)]
    return eng, workers


def push(eng: RoundEngine, worker: int, now: float, *, steps: int | None, scale: float = 0.01):
    rounds = eng.blocks[0].rounds
    meta: dict[str, object] = {} if steps is None else {"steps": steps}
    body = delta_body(
        0, base_version=rounds.version, round=rounds.round, scale=scale, worker=worker, **meta
    )
    checked = eng.inspect(0, body)
    verdict = checked.verdict
    if verdict.accepted:
        assert checked.meta is not None
        verdict = eng.judge(worker, 0, checked.meta, now)
    eng.record(worker, 0, verdict, now, checked=checked)
    eng.tick(now)
    return verdict


def test_fit_steps_clamps_to_between_an_eighth_of_h_and_h() -> None:
    assert fit_steps(25, 0.8, 10.0, 1.0) == 8  # floor(0.8 x 10 / 1)
    assert fit_steps(25, 0.8, 1000.0, 1.0) == 25, "never more than H"
    assert fit_steps(25, 0.8, 0.1, 1.0) == fewest_steps(25) == 3, "at least H // 8"
    assert fit_steps(25, 0.8, -5.0, 1.0) == 3, "a deadline already past: the fewest"
    assert fewest_steps(3) == 1 and fit_steps(3, 0.8, 0.0, 2.0) == 1
    assert steps_share(None, 10) == 1.0 and steps_share(4, 10) == 0.4 and steps_share(20, 10) == 1


def test_a_measured_slow_worker_is_told_fewer_steps_and_a_fast_one_keeps_h() -> None:
    eng, (fast, slow) = engine()
    assert eng.pull(fast, 0, 0.0).local_steps == 10, "no reading yet: H"
    assert eng.pull(slow, 0, 0.0).local_steps == 10
    assert push(eng, fast, 10.0, steps=10).accepted  # 1 s a step, pull to push
    late = push(eng, slow, 40.0, steps=10)  # 4 s a step: after the deadline at 30
    assert late.reason == "late"
    assert eng.pacer.pace(fast) == pytest.approx(1.0) and eng.pacer.pace(slow) == 4.0
    # round 1 opened at 30 (the deadline); both pull it at 40: 30 s left
    assert eng.pull(fast, 0, 40.0).local_steps == 10, "0.8 x 30 / 1 = 24: clamped to H"
    assert eng.pull(slow, 0, 40.0).local_steps == 6, "floor(0.8 x 30 / 4)"
    assert push(eng, fast, 50.0, steps=10, scale=0.01).accepted
    weights = {e.identity: e.weight for e in eng.blocks[0].acc.entries.values()}
    on_time = push(eng, slow, 40.0 + 6 * 4.0, steps=6, scale=0.03)  # 64 < its deadline at 70
    assert on_time.accepted, on_time
    assert eng.blocks[0].rounds.round == 2, "both passed: round 1 closed at once"
    # the shorter update's vote weighs 6 / 10: (0.01 + 0.6 x 0.03) / 1.6, not (0.01 + 0.03) / 2
    # (after round 0's 0.01, the fast worker's update alone)
    moved = eng.blocks[0].weights["embed"] - BASE["embed"]
    assert moved.mean().item() == pytest.approx(0.01 + (0.01 + 0.6 * 0.03) / 1.6, rel=2e-3)
    assert weights == {("worker", fast): 1.0}


def test_a_worker_that_pulls_late_in_the_round_is_told_what_fits_the_time_left() -> None:
    eng, (fast, slow) = engine()
    eng.pacer.readings[slow] = deque([1.0])  # measured: 1 s a step
    eng.pull(fast, 0, 0.0)  # starts the clock: the deadline is at 30
    assert eng.pull(slow, 0, 20.0).local_steps == 8, "floor(0.8 x 10 / 1)"
    assert eng.pull(slow, 0, 29.9).local_steps == fewest_steps(10) == 1


def test_a_push_over_its_assigned_steps_is_refused_as_bad_metadata() -> None:
    eng, (fast, slow) = engine()
    eng.pacer.readings[slow] = deque([4.0])  # measured: 4 s a step
    eng.pull(fast, 0, 0.0)
    assert eng.pull(slow, 0, 0.0).local_steps == 6
    refused = push(eng, slow, 20.0, steps=7)
    assert refused.reason == "bad_metadata" and "told 6" in refused.detail
    assert eng.blocks[0].acc.count == 0
    # more than H is refused under fixed pacing too; the form check refuses 0 steps
    fixed, (w, _) = engine(ADAPTIVE.replace(pacing="fixed"))
    fixed.pull(w, 0, 0.0)
    assert push(fixed, w, 5.0, steps=11).reason == "bad_metadata"
    fixed.pull(w, 0, 30.0)
    assert push(fixed, w, 35.0, steps=0).reason == "bad_metadata"


def test_an_update_without_steps_counts_as_h_and_fixed_pacing_always_tells_h() -> None:
    eng, (fast, slow) = engine(ADAPTIVE.replace(pacing="fixed"))
    eng.pull(fast, 0, 0.0)
    eng.pull(slow, 0, 0.0)
    assert push(eng, slow, 25.0, steps=None).accepted  # a worker from before pacing
    assert push(eng, fast, 5.0 + 25.0, steps=10).reason == "late"
    assert eng.pacer.pace(slow) == 2.5, "measured under fixed pacing too"
    assert eng.pull(slow, 0, 30.0).local_steps == 10, "but fixed pacing tells H"


def test_readings_are_the_median_of_the_recent_rounds_and_go_with_the_worker() -> None:
    pacer = Pacer(ADAPTIVE)
    meta = UpdateMeta(0, 0, 0, 100, None, 7, steps=10)
    for r, elapsed in enumerate([10.0, 10.0, 100.0, 10.0, 12.0, 11.0]):
        pacer.pulled(7, 0, r, 0.0, 30.0)
        pacer.observe(7, 0, UpdateMeta(0, 0, r, 100, None, 7, steps=10), Verdict.ok(), elapsed)
    assert pacer.pace(7) == 1.1, "the last 5 readings' median: one slow round does not move it"
    pacer.pulled(7, 0, 9, 0.0, 30.0)
    pacer.observe(7, 0, meta, Verdict.ok(), 99.0)  # names round 0, not its pull's 9: no reading
    pacer.observe(7, 0, UpdateMeta(0, 0, 9, 1, None, 7, 10), Verdict.refuse("busy"), 99.0)
    assert pacer.pace(7) == 1.1, "nor a push that was not judged"
    pacer.forget(7)
    assert pacer.pace(7) is None and pacer.steps_for(7, 30.0) == 10


def test_leave_forgets_the_pace() -> None:
    eng, (_, slow) = engine()
    eng.pull(slow, 0, 0.0)
    push(eng, slow, 20.0, steps=10)
    assert eng.pacer.pace(slow) == 2.0
    eng.leave(slow, 21.0)
    assert eng.pacer.pace(slow) is None
