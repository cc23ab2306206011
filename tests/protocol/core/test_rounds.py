"""The round state machine and the registry, driven with virtual time: no clock, no sleep."""

from __future__ import annotations

import pytest

from blocktrain.errors import ConfigError
from blocktrain.protocol.core.participation import in_time, participation
from blocktrain.protocol.core.registry import Registry
from blocktrain.protocol.core.rounds import BlockRounds, RoundClosed, restore
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import REASONS, Verdict

D = 10.0  # deadline


def fresh(**policy: object) -> BlockRounds:
    """Two replicas on block 0; the quorum is off (1) unless a test turns it on."""
    policy = {"quorum": 1.0, "min_round_s": 0.0, **policy}
    r = BlockRounds(0, AggregatorSettings(deadline_s=D, **policy))  # type: ignore[arg-type]
    for w in (1, 2):
        r.assign(w)
    return r


def push(
    r: BlockRounds,
    worker: int,
    now: float,
    *,
    round: int | None = None,
    version: int | None = None,
    tokens: int = 10,
) -> Verdict:
    rnd = r.round if round is None else round
    verdict = r.judge(
        worker, round=rnd, base_version=r.version if version is None else version, now=now
    )
    r.record(worker, verdict, round=rnd, now=now, update_id=100 * worker + rnd, tokens=tokens)
    return verdict


def test_deadline_starts_at_first_pull_and_closes_the_round():
    r = fresh()
    assert r.deadline is None and r.tick(1e9) is None, "an unstarted round never times out"
    view = r.pull(1, now=5.0)
    assert view.deadline == 5.0 + D and view.round == 0 and view.version == 0
    r.pull(2, now=7.0)
    assert r.deadline == 5.0 + D, "later pulls do not move the deadline"
    assert push(r, 1, now=8.0).accepted
    assert r.tick(14.999) is None, "replica 2 pulled and has not reported: wait"
    closed = r.tick(15.0)
    assert closed is not None and closed.cause == "deadline"
    assert [c.worker_id for c in closed.accepted] == [1]
    assert closed.new_version == 1 and r.round == 1 and r.version == 1
    assert closed.expected == {1, 2} and closed.reported == {1}
    assert of(closed) == 0.5


def test_update_after_the_deadline_is_late_and_not_counted():
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=3.0).accepted
    late = r.judge(2, round=0, base_version=0, now=D)  # exactly at the deadline
    assert not late.accepted and late.reason == "late", late
    assert REASONS[late.reason][0] == 409
    closed = r.tick(D)
    assert closed is not None and closed.cause == "deadline"
    assert [c.worker_id for c in closed.accepted] == [1], "the late update is not aggregated"
    again = r.judge(2, round=0, base_version=0, now=D + 1)
    assert not again.accepted and again.reason == "late" and "closed" in again.detail


def test_round_closes_early_when_every_expected_replica_reported():
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=1.0)
    assert push(r, 1, now=2.0).accepted
    assert r.tick(2.0) is None
    assert push(r, 2, now=3.0).accepted
    closed = r.tick(3.0)
    assert closed is not None and closed.cause == "all_reported" and closed.closed_at == 3.0
    assert len(closed.accepted) == 2 and of(closed) == 1.0


def test_a_refused_update_is_a_report_but_never_closes_a_round_early():
    """Finding "quorum stuffing": a refused push counted as a report, so junk that cost its
    token nothing met the quorum (or "every replica reported") and closed rounds before the
    honest workers finished. A refused push is still a report (the worker is alive, and a
    second push is a duplicate), but only updates that passed close a round early: refusals
    alone wait for the deadline."""
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    r.record(1, Verdict.refuse("bad_dtype", "junk"), round=0, now=1.0)
    r.record(2, Verdict.refuse("non_finite", "NaN"), round=0, now=2.0)
    assert r.tick(2.0) is None and r.tick(D - 0.1) is None, "reported, but nothing passed"
    assert r.judge(2, round=0, base_version=0, now=3.0).reason == "duplicate"
    closed = r.tick(D)
    assert closed is not None and closed.cause == "deadline"
    assert closed.refused == 2 and not closed.accepted and closed.reported == {1, 2}


def test_a_round_stops_waiting_for_a_replica_refused_in_it():
    """Finding "quorum stuffing", its second half: junk pushers on tokens of their own are
    expected replicas that never pass, so every round ran to its deadline (12 s against 3 s).
    A replica refused in the round can no longer pass it (a second push is a duplicate), so
    the round closes once every other expected replica passed."""
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=1.0).accepted
    assert r.tick(1.0) is None, "worker 2 may still pass"
    r.record(2, Verdict.refuse("non_finite", "NaN"), round=0, now=2.0)
    closed = r.tick(2.0)
    assert closed is not None and closed.cause == "all_reported"
    assert closed.refused == 1 and len(closed.accepted) == 1 and closed.reported == {1, 2}


def test_refused_pushes_never_meet_the_quorum():
    """Two attacker replicas pushing junk at once against two honest ones (quorum 0.5): the
    round waits for the honest updates, and closes on them."""
    r = fresh(quorum=0.5, grace_s=0.0)
    for w in (3, 4):
        r.assign(w)
    for w in (1, 2, 3, 4):
        r.pull(w, now=0.0)
    for w in (3, 4):
        r.record(w, Verdict.refuse("bad_dtype", "junk"), round=0, now=0.1)
    assert r.tick(0.1) is None and r.quorum_at is None, "junk is no quorum"
    assert r.tick(D / 2) is None
    assert push(r, 1, now=6.0).accepted
    assert push(r, 2, now=7.0).accepted
    closed = r.tick(7.0)
    assert closed is not None and closed.cause == "all_reported" and len(closed.accepted) == 2


def test_a_round_cannot_close_before_its_minimum_length():
    """Even updates that pass cannot close a round in a burst: by default a round stays open
    for a quarter of its deadline from its first pull (min_round_s)."""
    r = fresh(quorum=0.5, grace_s=0.0, min_round_s=None)
    assert r.policy.min_round == D / 4
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=0.1).accepted
    assert push(r, 2, now=0.2).accepted
    assert r.tick(0.2) is None and r.tick(D / 4 - 0.01) is None, "every replica passed: wait"
    closed = r.tick(D / 4)
    assert closed is not None and closed.cause == "all_reported"
    r.pull(1, now=D / 4)
    assert push(r, 1, now=D / 4 + 0.1).accepted
    assert r.tick(D / 4 + 0.1) is None, "the quorum alone waits for the minimum too"
    closed = r.tick(D / 2)
    assert closed is not None and closed.cause == "quorum"
    fast = fresh(min_round_s=0.0)
    fast.pull(1, now=0.0)
    fast.pull(2, now=0.0)
    assert push(fast, 1, now=0.1).accepted and push(fast, 2, now=0.2).accepted
    assert fast.tick(0.2) is not None, "min_round_s = 0: no minimum"


def test_a_round_without_accepted_updates_keeps_the_version():
    r = fresh()
    r.pull(1, now=0.0)
    closed = r.tick(D)
    assert closed is not None and closed.new_version == 0 and not closed.accepted
    assert r.round == 1 and r.version == 0


def test_timing_refusals():
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert r.judge(1, round=1, base_version=0, now=1).reason == "future_round"
    assert r.judge(1, round=0, base_version=3, now=1).reason == "stale_version"
    assert push(r, 1, now=1.0).accepted
    assert r.judge(1, round=0, base_version=0, now=2).reason == "duplicate"


def test_staleness_bound_counts_a_late_update_in_the_next_round_down_weighted():
    r = fresh(staleness=1, stale_weight=0.25)
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=1.0).accepted
    assert r.tick(D) is not None  # round 0 closes without replica 2
    late = push(r, 2, now=D + 2, round=0, version=0)
    assert late.accepted and late.weight == 0.25 and late.counts_in == 1, late
    assert r.judge(2, round=0, base_version=0, now=D + 3).reason == "duplicate"
    r.pull(1, now=D + 3)
    r.pull(2, now=D + 3)
    assert push(r, 1, now=D + 4).accepted and push(r, 2, now=D + 4).accepted
    closed = r.tick(D + 4)
    assert closed is not None and closed.round == 1
    assert sorted((c.worker_id, c.round, c.weight) for c in closed.accepted) == [
        (1, 1, 1.0),
        (2, 0, 0.25),
        (2, 1, 1.0),
    ]
    assert closed.base_version == 1 and closed.new_version == 2
    # two rounds late is beyond the bound
    assert r.judge(2, round=0, base_version=0, now=D + 5).reason == "late"


def test_a_dead_worker_stalls_its_block_for_at_most_one_deadline():
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)  # worker 2 dies after this pull
    assert push(r, 1, now=1.0).accepted
    assert r.tick(5.0) is None
    closed = r.tick(D)
    assert closed is not None and closed.cause == "deadline", "round 0 waits one deadline"
    # round 1: worker 2 neither pulled it nor pushed for round 0, so it is not expected
    r.pull(1, now=D + 1)
    assert r.expected() == {1}
    assert push(r, 1, now=D + 2).accepted
    closed = r.tick(D + 2)
    assert closed is not None and closed.cause == "all_reported", "no second stall"


def test_a_late_but_alive_worker_is_expected_in_the_next_round():
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=1.0).accepted
    assert r.tick(D) is not None
    r.pull(1, now=D)
    assert push(r, 2, now=D + 1, round=0, version=0).reason == "late"
    assert r.expected() == {1, 2}, "it pushed for the previous round: it is alive"
    assert push(r, 1, now=D + 2).accepted
    assert r.tick(D + 2) is None, "wait for the slow but alive replica"


def test_a_leaving_worker_is_no_longer_waited_for():
    r = fresh()
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=1.0).accepted
    r.unassign(2)
    closed = r.tick(1.5)
    assert closed is not None and closed.cause == "all_reported"


def test_max_rounds_marks_the_block_done():
    r = fresh(max_rounds=1)
    r.pull(1, now=0.0)
    assert push(r, 1, now=1.0).accepted
    r.unassign(2)
    assert r.tick(1.0) is not None
    assert r.done and r.view().done
    assert r.judge(1, round=1, base_version=1, now=2).reason == "done"
    assert r.tick(1e9) is None


def test_restore_rebuilds_the_open_round():
    r = fresh(staleness=1)
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=1.0).accepted
    again = restore(
        0,
        r.policy,
        round=r.round,
        version=r.version,
        started_at=r.started_at,
        assigned=r.assigned,
        pulled=r.pulled,
        reported=r.reported,
        prev_reported=r.prev_reported,
        accepted=r.accepted,
        refused=r.refused,
        published=r.published,
    )
    assert again.expected() == r.expected() and again.deadline == r.deadline
    assert again.judge(1, round=0, base_version=0, now=2).reason == "duplicate"
    assert push(again, 2, now=2.0).accepted
    closed = again.tick(2.0)
    assert closed is not None and {c.worker_id for c in closed.accepted} == {1, 2}


def test_policy_checks_its_fields():
    for bad in ({"deadline_s": 0}, {"staleness": -1}, {"stale_weight": 0}, {"max_rounds": 0}):
        (name,) = bad
        with pytest.raises(ConfigError, match=f"setting {name} = "):
            AggregatorSettings(**bad)  # type: ignore[arg-type]


def test_participation_counts_only_the_rounds_own_updates():
    """An update counted late (staleness 1) is aggregated in the next round but is not part of
    that round's participation: it is its own round's, come too late."""
    r = fresh(staleness=1)
    r.pull(1, now=0.0)
    r.pull(2, now=0.0)
    assert push(r, 1, now=1.0).accepted
    first = r.tick(D)  # worker 2 missed the deadline
    assert first is not None and of(first) == 0.5
    r.pull(1, now=D + 1)
    late = r.judge(2, round=0, base_version=0, now=D + 2)
    assert late.accepted and late.weight == 0.5, late
    r.record(2, late, round=0, now=D + 2, tokens=10)
    assert push(r, 1, now=D + 3).accepted
    assert r.tick(D + 3) is None, "worker 2 is alive (it pushed for round 0): expected"
    second = r.tick(2 * D + 1)
    assert second is not None and second.expected == {1, 2}
    assert len(second.accepted) == 2 and in_time(second) == 1
    assert of(second) == 0.5, "the late update of round 0 does not count for round 1"
    assert participation(0, 0) == 0.0 and participation(1, 0) == 1.0


def of(closed: RoundClosed) -> float:
    return participation(in_time(closed), len(closed.expected))


def test_registry_assigns_the_block_with_fewest_live_replicas():
    reg = Registry(blocks=3, live_window_s=30.0)
    picks = []
    for w in range(6):
        b = reg.choose_block(now=0.0)
        reg.add(w, b, now=0.0)
        picks.append(b)
    assert picks == [0, 1, 2, 0, 1, 2], "two replicas per block, filled evenly"
    assert reg.choose_block(0.0, requested=2) == 2
    with pytest.raises(ValueError):
        reg.choose_block(0.0, requested=3)
    # workers 0 and 3 (block 0) go silent: block 0 has no live replica left
    for w in (1, 2, 4, 5):
        reg.seen(w, 40.0)
    assert reg.live_per_block(40.0) == [0, 2, 2]
    assert reg.choose_block(40.0) == 0
    assert reg.choose_block(40.0, exclude=[0]) == 1, "finished blocks are skipped"


def test_rounds_module_stays_free_of_http_sqlite_and_torch():
    import ast
    from pathlib import Path

    import blocktrain.protocol.core.rounds as rounds_module
    import blocktrain.protocol.core.verdict as verdict_module

    for module in (rounds_module, verdict_module):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        imported |= {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert not imported & {"torch", "sqlite3", "httpx", "fastapi", "starlette"}, (
            f"{module.__name__} imports {imported}"
        )


# ------------------------------------------------------------------------------ liveness


def test_a_worker_that_pulls_and_never_pushes_stops_holding_rounds_up():
    """Finding "a worker that pulls and never pushes makes every round wait for its deadline":
    pulls do not keep a worker expected; once the live window passes without a report from
    it, rounds close as soon as the others reported (the quorum is off here, to show this
    alone)."""
    r = fresh(live_window_s=2.5 * D)
    for w in (1, 2):
        r.assign(w, now=0.0)
    causes = []
    t = 0.0
    for _ in range(6):
        r.pull(1, now=t)
        r.pull(2, now=t)  # worker 2 pulls every round and never pushes
        assert push(r, 1, now=t + 1).accepted
        closed = r.tick(t + 1) or r.tick(t + D)
        assert closed is not None
        causes.append(closed.cause)
        t = closed.closed_at
    assert causes[:3] == ["deadline"] * 3, "heard at registration: waited for, for a while"
    assert causes[3:] == ["all_reported"] * 3, "then no longer"


def test_a_reporting_worker_stays_expected_across_many_rounds():
    r = fresh(live_window_s=1.5 * D)
    for w in (1, 2):
        r.assign(w, now=0.0)
    t = 0.0
    for _ in range(5):
        r.pull(1, now=t)
        r.pull(2, now=t)
        assert push(r, 1, now=t + 1).accepted
        assert r.tick(t + 8) is None, "worker 2 reported last round: the round waits for it"
        assert push(r, 2, now=t + 9).accepted
        closed = r.tick(t + 9)
        assert closed is not None and closed.cause == "all_reported"
        t += 9


def test_the_quorum_closes_a_round_after_the_grace_period():
    r = fresh(quorum=0.5, grace_s=2.0)
    r.assign(3, now=0.0)
    for w in (1, 2, 3):
        r.pull(w, now=0.0)
    assert push(r, 1, now=1.0).accepted
    assert r.tick(3.5) is None, "one of three is not a quorum of 0.5"
    assert push(r, 2, now=4.0).accepted
    assert r.tick(5.9) is None, "quorum at 4.0: the grace period runs to 6.0"
    closed = r.tick(6.0)
    assert closed is not None and closed.cause == "quorum" and closed.closed_at < D
    assert closed.expected == {1, 2, 3} and closed.reported == {1, 2}
    assert r.quorum_at is None, "the next round starts without a quorum"


def test_the_default_grace_is_as_long_as_the_quorum_took():
    r = fresh(quorum=0.5)
    for w in (1, 2):
        r.pull(w, now=0.0)
    assert push(r, 1, now=3.0).accepted
    assert r.tick(5.9) is None
    closed = r.tick(6.0)
    assert closed is not None and closed.cause == "quorum"
    r2 = fresh(quorum=0.5)
    for w in (1, 2):
        r2.pull(w, now=0.0)
    assert push(r2, 1, now=0.0).accepted
    assert r2.tick(D / 10 - 0.01) is None, "at least a tenth of the deadline"
    assert r2.tick(D / 10) is not None


def test_restore_finds_when_the_quorum_reported():
    r = fresh(quorum=0.5, grace_s=2.0)
    r.assign(3, now=0.0)
    for w in (1, 2, 3):
        r.pull(w, now=0.0)
    assert push(r, 1, now=1.0).accepted
    assert push(r, 2, now=4.0).accepted
    again = restore(
        0,
        r.policy,
        round=0,
        version=0,
        started_at=0.0,
        assigned=r.assigned,
        pulled=r.pulled,
        reported=r.reported,
        prev_reported=set(),
        accepted=r.accepted,
        refused=0,
        published={0: 0},
        report_times={1: 1.0, 2: 4.0},
    )
    assert again.quorum_at == r.quorum_at == 4.0
    closed = again.tick(6.0)
    assert closed is not None and closed.cause == "quorum"


def test_blocks_are_chosen_by_identities_not_workers():
    """Finding "honest workers were steered away": ten workers of one token on block 0 are one
    voice there; pinned tokens choose among their blocks only."""
    reg = Registry(blocks=3, live_window_s=30.0)
    for w in range(10):
        reg.add(w, 0, now=0.0, token=7)
    assert reg.live_per_block(0.0) == [1, 0, 0]
    reg.add(10, 1, now=0.0, token=8)
    reg.add(11, 2, now=0.0)
    assert reg.choose_block(0.0) == 0, "ties: lowest index; the flood counts once"
    assert reg.choose_block(0.0, allowed=[1, 2]) == 1
    assert reg.workers_of(7) == list(range(10))
