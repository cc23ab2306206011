"""One aggregator per block: two aggregator apps served over real HTTP in this process, each
with its own state folder, serving one block each and naming the other as a peer; workers
pointed at either follow the directory to their block's aggregator."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from blocktrain.cli.main import main
from blocktrain.errors import ConfigError, Refused
from blocktrain.listener import ThreadedServer, bind, url_of
from blocktrain.protocol.core.bodies import decode
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.service.placement import Directory, parse_peer
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.protocol.worker.client import AggregatorClient, Registration
from blocktrain.protocol.worker.loop import WorkerLoop
from tests.protocol.conftest import SETTINGS, T0, auth, make_state
from tests.protocol.worker.test_worker import FakeTrainer


@pytest.fixture
def pair(tmp_path):
    """Aggregators A (block 0) and B (block 1) of one 2-block run, and two tokens both know."""
    states = [make_state(tmp_path / name, SETTINGS.replace(max_rounds=3)) for name in "AB"]
    tokens = [new_token(), new_token()]
    for state in states:
        for i, token in enumerate(tokens):
            state.ledger.add_token(f"t{i}", hash_token(token), T0)
    socks = [bind("127.0.0.1", 0) for _ in states]
    urls = [url_of(s) for s in socks]
    servers = []
    for b, (state, sock) in enumerate(zip(states, socks, strict=True)):
        directory = Directory.build(2, [b], {1 - b: urls[1 - b]})
        servers.append(ThreadedServer.start(create_app(storage=state, directory=directory), sock))
    yield urls, tokens, states
    for server in servers:
        server.stop()
    for state in states:
        state.close()


def test_each_aggregator_serves_its_block_and_names_the_other(pair):
    (a, b), (token, _), _ = pair
    with httpx.Client(base_url=a) as http:
        doc = http.get("/v1/directory", headers=auth(token)).json()
        assert doc == {"blocks": {"0": a, "1": b}, "served": [0]}
        assert http.get("/v1/config", headers=auth(token)).json()["directory"] == doc
        r = http.post("/v1/workers", json={"block": 1}, headers=auth(token))
        assert r.status_code == 421 and r.json()["reason"] == "wrong_aggregator"
        assert b in r.json()["detail"]
        assert http.get("/v1/blocks/1/round", headers=auth(token)).status_code == 421
        assert http.post("/v1/workers", json={}, headers=auth(token)).json()["block"] == 0
    with httpx.Client(base_url=b) as http:  # an unpinned registration: a block served here
        assert http.post("/v1/workers", json={}, headers=auth(token)).json()["block"] == 1


def test_workers_follow_the_directory_to_their_blocks(pair):
    (a, b), tokens, states = pair
    reports = []
    for block, token in enumerate(tokens):  # both start at A; the worker of block 1 moves to B
        client = AggregatorClient(a, token, rng=random.Random(0))
        loop = WorkerLoop(client, lambda reg, cfg: FakeTrainer(), block=block)
        reports.append(loop.run())
        assert client.base_url == (a, b)[block]
        client.close()
    for block, report in enumerate(reports):
        assert report.block == block and report.stopped_by == "done" and report.accepted == 3
    for block, state in enumerate(states):  # each block's rounds ran on its own aggregator
        assert state.ledger.block_state(block)[0] == 3
        assert state.ledger.block_state(1 - block)[0] == 0


def test_a_features_worker_reads_its_upstream_block_from_its_aggregator(pair):
    """route = features, one aggregator per block: the worker of block 1 (at B) reads block 0's
    latest version from A, where the directory says it lives, with the same token, and counts
    those bytes; it asks the directory once, and fetches a version it holds not again."""
    (a, b), (token, _), _ = pair
    trainer = FakeTrainer(upstream_blocks=[0])
    client = AggregatorClient(b, token, rng=random.Random(0))
    report = WorkerLoop(client, lambda reg, cfg: trainer, block=1).run()
    assert report.stopped_by == "done" and report.accepted == 3 and client.base_url == b
    with httpx.Client(base_url=a) as http:
        body = http.get("/v1/blocks/0/versions/0", headers=auth(token)).content
        by_endpoint = http.get("/v1/status", headers=auth(token)).json()["bytes"]["by_endpoint"]
    expected = decode(body).to_torch()
    assert len(trainer.upstream) == 3
    for upstream in trainer.upstream:
        assert sorted(upstream) == [0]
        assert all(torch.equal(upstream[0][k], expected[k].float()) for k in expected)
    # A answered the worker's round each round, and version 0's body once to it (and once here)
    assert by_endpoint["round"]["requests"] == 3
    assert by_endpoint["weights"] == {"requests": 2, "bytes_in": 0, "bytes_out": 2 * len(body)}
    assert client.bytes_down >= len(body)
    assert list(client._elsewhere) == [0]
    client.close()


def test_a_worker_refused_as_misdirected_moves_and_registers_again(pair):
    (a, b), (token, _), _ = pair
    client = AggregatorClient(b, token, rng=random.Random(0))
    loop = WorkerLoop(client, lambda reg, cfg: FakeTrainer(), block=None)
    stale = Registration(99, 0, 0, 2, "fp16", "fp16")  # a worker of block 0, talking to B
    new = loop._handle_refusal(Refused("wrong_aggregator", "moved", 421), stale)
    assert client.base_url == a and new.block == 0 and new.worker_id != 99
    client.close()


def test_directory_syntax_and_checks():
    assert parse_peer("2=http://h:1/") == (2, "http://h:1")
    for bad in ("2", "x=http://h", "=http://h", "-1=http://h", "1="):
        with pytest.raises(ConfigError):
            parse_peer(bad)
    with pytest.raises(ConfigError, match="served here"):
        Directory.build(3, [0], {0: "http://h"})
    with pytest.raises(ConfigError, match="not a block"):
        Directory.build(3, [5])
    with pytest.raises(ConfigError, match="expected"):
        Directory.build(3, [0], {1: "ftp://h"})


def test_token_add_writes_one_token_to_several_states(tmp_path, capsys):
    states = [str(tmp_path / "A"), str(tmp_path / "B")]
    assert main(["token", "add", "carol", "--state", states[0], "--state", states[1]]) == 0
    token = capsys.readouterr().out.strip()
    for path in states:
        state = StateDir(tmp_path / path)
        row = state.ledger.token_by_hash(hash_token(token))
        assert row is not None and row.name == "carol"
        state.close()
    assert main(["token", "add", "carol", "--state", states[0], "--state", states[1]]) == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--blocks", "x"], "--blocks 'x'"), (["--peer", "one=http://h"], "--peer 'one=http://h'")],
)
def test_bad_blocks_and_peers_exit_2_before_any_state_is_made(tmp_path, capsys, flags, message):
    argv = ["aggregator", "--state", str(tmp_path / "s"), "--preset", "tiny", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
