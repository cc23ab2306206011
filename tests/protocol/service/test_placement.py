"""A per-block aggregator holds only its blocks: `/v1/status`, `/metrics`, the ledger and the
traffic counters name no other block, and the state folder remembers which blocks it serves
(and where the others live) across restarts."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from blocktrain.cli.aggregator_state import AggregatorSetup, prepare_state
from blocktrain.cli.main import build_parser, main
from blocktrain.errors import ConfigError
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.service.placement import Directory
from blocktrain.protocol.store.storage import MANIFEST, StateDir
from tests.protocol.conftest import SETTINGS, FakeClock, add_token, auth, delta_body, make_state

PEER = "http://agg-b:8471"


def served_app(state: StateDir, clock: FakeClock, directory: Directory | None = None):
    return TestClient(
        create_app(storage=state, clock=clock, directory=directory), base_url="http://a"
    )


def test_a_per_block_aggregator_shows_and_keeps_only_its_block(tmp_path):
    """Aggregator A serves block 0 of a 2-block run, B (at PEER) block 1. Requests to A for
    block 1 are refused as misdirected and, like the rounds A runs, leave nothing of block 1."""
    state = make_state(tmp_path / "A", SETTINGS.replace(max_rounds=5))
    token = add_token(state, "alice")
    clock = FakeClock()
    http = served_app(state, clock, Directory.build(2, [0], {1: PEER}))
    service = http.app.state.service  # type: ignore[attr-defined]
    assert sorted(service.blocks) == [0], "block 1's weights are not even loaded"
    worker = http.post("/v1/workers", json={}, headers=auth(token)).json()["worker_id"]
    for r in range(2):  # two rounds of block 0: one reported, one closed by its deadline
        assert http.get("/v1/blocks/0", headers=auth(token, worker)).status_code == 200
        if r == 0:
            body = delta_body(0, base_version=0, round=0)
            pushed = http.post("/v1/blocks/0/updates", content=body, headers=auth(token, worker))
            assert pushed.status_code == 200, pushed.text
        for path in ("/v1/blocks/1", "/v1/blocks/1/round", "/v1/blocks/1/versions/0"):
            r1 = http.get(path, headers=auth(token, worker))
            assert r1.status_code == 421 and PEER in r1.json()["detail"], path
        push = http.post("/v1/blocks/1/updates", content=delta_body(1), headers=auth(token, worker))
        assert push.status_code == 421
        assert http.post("/v1/workers", json={"block": 1}, headers=auth(token)).status_code == 421
        clock.advance(SETTINGS.deadline_s + 1)
        service.tick()
    status = http.get("/v1/status", headers=auth(token)).json()
    assert [b["block"] for b in status["blocks"]] == [0]
    assert (status["served"], status["peers"]) == ([0], {"1": PEER})
    assert status["versions"] == [1] and status["rounds"] == [2]
    assert len(status["workers"]["per_block"]) == 1
    assert list(status["participation"]) == ["0"]
    assert set(status["bytes"]["by_block"]) == {"0"}, "misdirected requests count under no block"
    metrics = http.get("/metrics").text
    assert 'block="0"' in metrics and 'block="1"' not in metrics
    ledger = state.ledger
    assert [r["cause"] for r in ledger.rounds(0)] == ["all_reported", "deadline"]
    assert ledger.rounds(1) == [] and ledger.block_state(1) == (0, 0, None)
    assert all(u.block != 1 for u in ledger.updates()), "the refused push names no block"
    assert all(row["block"] != 1 for row in ledger.traffic())
    assert state.versions(1) == [0]
    state.close()


def test_the_first_start_saves_the_blocks_and_a_restart_without_flags_serves_them(tmp_path):
    state = make_state(tmp_path / "A")
    clock = FakeClock()
    served_app(state, clock, Directory.build(2, [1], {0: PEER}))
    assert state.placement() == ([1], {0: PEER})
    state.close()
    state = StateDir(tmp_path / "A")
    service = served_app(state, clock).app.state.service  # type: ignore[attr-defined]
    assert service.directory == Directory(2, (1,), {0: PEER}) and sorted(service.blocks) == [1]
    with pytest.raises(ConfigError, match=r"--blocks 0 disagrees with .*serves block\(s\) 1"):
        served_app(state, clock, Directory.build(2, [0]))
    state.close()


def test_a_folder_older_than_the_record_takes_the_blocks_of_its_next_start(tmp_path):
    state = make_state(tmp_path / "A")
    doc = json.loads((tmp_path / "A" / MANIFEST).read_text())
    assert "served" not in doc and state.placement() == (None, {})
    served_app(state, FakeClock(), Directory.build(2, [0]))
    assert state.placement() == ([0], {})
    state.close()


def aggregator_args(tmp_path, *flags: str):
    args = build_parser().parse_args(["aggregator", "--state", str(tmp_path / "s"), *flags])
    return AggregatorSetup.of(args)


def test_the_cli_saves_blocks_and_peers_and_restarts_agree_with_them(tmp_path):
    state, _, directory = prepare_state(
        aggregator_args(tmp_path, "--preset", "tiny", "--blocks", "0", "--peer", f"1={PEER}")
    )
    assert directory.served == (0,) and state.placement() == ([0], {1: PEER})
    state.close()
    # no flag: what the state says; an agreeing --blocks is fine
    for flags in ((), ("--blocks", "0")):
        state, _, directory = prepare_state(aggregator_args(tmp_path, *flags))
        assert directory == Directory(3, (0,), {1: PEER})
        state.close()
    # a peer moved: the new URL replaces the saved one, the other peers stay
    moved = "http://agg-b2:8471"
    args = aggregator_args(tmp_path, "--peer", f"1={moved}", "--peer", "2=http://c:1")
    state, _, directory = prepare_state(args)
    assert directory.peers == {1: moved, 2: "http://c:1"}
    state.close()
    state, _, directory = prepare_state(aggregator_args(tmp_path))
    assert state.placement() == ([0], {1: moved, 2: "http://c:1"})
    state.close()


def test_a_restart_with_other_blocks_exits_2_and_changes_nothing(tmp_path, capsys):
    state = make_state(tmp_path / "s", blocks=3)
    served_app(state, FakeClock(), Directory.build(3, [0]))
    state.close()
    before = (tmp_path / "s" / MANIFEST).read_bytes()
    argv = ["aggregator", "--state", str(tmp_path / "s"), "--blocks", "1", "--deadline", "5"]
    assert main([*argv, "--effect-probe", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--blocks 1 disagrees with" in err[0]
    assert "serves block(s) 0" in err[0]
    assert (tmp_path / "s" / MANIFEST).read_bytes() == before, "not even the --deadline"


def test_a_new_state_with_a_bad_directory_exits_2_before_it_is_made(tmp_path, capsys):
    argv = ["aggregator", "--state", str(tmp_path / "s"), "--preset", "tiny", "--blocks", "0"]
    assert main([*argv, "--peer", "0=http://h:1"]) == 2
    assert "block 0 is served here" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
