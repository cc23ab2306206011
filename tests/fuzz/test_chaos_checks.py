"""The invariants bench/chaos.py checks after its soak (bench/chaos_checks.py) hold on a real
ledger after a round, and fail when the ledger is broken: the checks can fail."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.protocol.conftest import Harness, delta_body, make_harness

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from chaos_checks import check_ledger, sampled_monotonic  # bench/chaos_checks.py


@pytest.fixture
def closed_round(tmp_path: Path) -> Iterator[Harness]:
    """Block 0 after one round with two accepted updates, and one accepted in the open round."""
    h = make_harness(tmp_path / "state")
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]
    for token, w in ((h.alice, a), (h.bob, b)):
        assert h.pull(token, w, 0).status_code == 200
    for token, w in ((h.alice, a), (h.bob, b)):
        assert h.push(token, w, 0, delta_body(0)).status_code == 200
    assert h.service.blocks[0].rounds.round == 1
    assert h.pull(h.alice, a, 0).status_code == 200
    r = h.push(h.alice, a, 0, delta_body(0, base_version=1, round=1))
    assert r.status_code == 200, r.text
    yield h
    h.state.close()


def test_a_real_ledger_is_consistent(closed_round: Harness) -> None:
    out = check_ledger(closed_round.state)
    assert out == {"consistent": True, "versions_monotonic": True, "problems": []}


@pytest.mark.parametrize(
    ("sql", "finds"),
    [
        ("UPDATE updates SET committed_version = NULL WHERE counts_in = 0", "in no version"),
        ("UPDATE updates SET committed_version = 7 WHERE counts_in = 0", "not that of its round"),
        ("UPDATE updates SET committed_version = 1 WHERE counts_in = 1", "not that of its round"),
        ("UPDATE rounds SET accepted = 3", "accepted per the round"),
        ("UPDATE rounds SET new_version = 0", "after version 0"),
        ("UPDATE blocks SET round = 2 WHERE block = 0", "not contiguous"),
    ],
)
def test_a_broken_ledger_is_caught(closed_round: Harness, sql: str, finds: str) -> None:
    with closed_round.state.ledger._tx() as db:
        db.execute(sql)
    out = check_ledger(closed_round.state)
    assert not out["consistent"]
    assert any(finds in p for p in out["problems"]), out["problems"]


def test_status_samples_must_not_go_back() -> None:
    assert sampled_monotonic([[0, 0], [1, 0], [1, 2]])
    assert not sampled_monotonic([[0, 3], [1, 2]])
