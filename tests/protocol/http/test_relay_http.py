"""Relayed streams over HTTP (route = relay): the routes, their refusals, and real workers of a
micro run that train each block on the streams of the block before."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import load_split
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.loop import WorkerLoop
from blocktrain.relaystream import Shape, StreamWriter
from blocktrain.training.local import local_trainer
from tests.asgi import answered_by
from tests.conftest import micro_config
from tests.protocol.conftest import FakeClock, auth, run_state

SETTINGS = {"deadline_s": 30.0, "local_steps": 2, "min_round_s": 0.0, "max_rounds": 3}


def relay_config() -> RunConfig:
    return apply_overrides(micro_config(), ["route=relay"])


class Aggregator:
    """A relay run's aggregator in this process, and the bodies of the streams pushed to it."""

    def __init__(self, root: Path, cfg: RunConfig, settings: dict = SETTINGS) -> None:
        self.state = run_state(root, cfg, settings)
        self.token = new_token()
        self.state.ledger.add_token("alice", hash_token(self.token), 0.0)
        self.app = TestClient(
            create_app(storage=self.state, clock=FakeClock()), base_url="http://agg"
        )
        self.app.__enter__()
        self.streams_pushed: list[int] = []

    def client(self) -> AggregatorClient:
        def handler(request: httpx.Request) -> httpx.Response:
            request.read()  # an upload from chunks
            if request.method == "POST" and request.url.path.endswith("/streams"):
                self.streams_pushed.append(len(request.content))
            return answered_by(self.app, request)

        return AggregatorClient("http://agg", self.token, transport=httpx.MockTransport(handler))

    def close(self) -> None:
        self.app.__exit__(None, None, None)
        self.state.close()


@pytest.fixture
def agg(tmp_path):
    a = Aggregator(tmp_path / "state", relay_config())
    yield a
    a.close()


SHAPE = Shape(4, 16, 32)


def stream_body(steps: int = 1, shape: Shape = SHAPE) -> bytes:
    writer = StreamWriter(shape)
    for _ in range(steps):
        writer.add(
            torch.zeros(shape.batch, shape.seq_len, dtype=torch.long),
            torch.ones(shape.batch, shape.seq_len, shape.d_model),
        )
    return writer.finish({}).read()


def register(agg: Aggregator, block: int) -> int:
    r = agg.app.post("/v1/workers", json={"block": block}, headers=auth(agg.token))
    assert r.status_code == 200, r.text
    return int(r.json()["worker_id"])


def test_a_stream_is_kept_only_after_its_round_s_delta_and_refused_where_none_is_relayed(agg):
    worker = register(agg, 0)
    url = "/v1/blocks/0/streams?round=0"
    r = agg.app.post(url, content=stream_body(), headers=auth(agg.token, worker))
    assert r.status_code == 409 and r.json()["reason"] == "no_update", r.text
    last = register(agg, 2)
    r = agg.app.post(
        "/v1/blocks/2/streams?round=0", content=stream_body(), headers=auth(agg.token, last)
    )
    assert r.status_code == 404 and r.json()["reason"] == "not_relayed"
    r = agg.app.get("/v1/blocks/0/streams", headers=auth(agg.token, 7))
    assert r.status_code == 204, "none yet: an empty answer after the wait"
    r = agg.app.get("/v1/blocks/0/streams")
    assert r.status_code == 401, "a token first"
    big = agg.app.post(
        url,
        content=b"x" * (agg.app.app.state.service.max_stream_body + 1),
        headers=auth(agg.token, worker),
    )
    assert big.status_code == 413


def test_a_stream_of_another_shape_is_refused_with_its_reason(agg):
    worker = register(agg, 0)
    service = agg.app.app.state.service
    # its delta of round 0 accepted, as the ledger records one
    service.ledger.record_update(
        received=0.0,
        bytes=1,
        fate="accepted",
        token_id=1,
        worker_id=worker,
        block=0,
        round=0,
        base_version=0,
        tokens=1,
        weight=1.0,
        counts_in=0,
        seen=0.0,
    )
    r = agg.app.post(
        "/v1/blocks/0/streams?round=0",
        content=stream_body(shape=Shape(4, 16, 16)),
        headers=auth(agg.token, worker),
    )
    assert r.status_code == 400 and r.json()["reason"] == "bad_shape", r.text
    ok = agg.app.post(
        "/v1/blocks/0/streams?round=0", content=stream_body(2), headers=auth(agg.token, worker)
    )
    assert ok.status_code == 200 and ok.json()["steps"] == 2, ok.text
    got = agg.app.get("/v1/blocks/0/streams", headers=auth(agg.token, 5))
    assert got.status_code == 200 and got.headers["X-Relay-Round"] == "0"
    assert got.headers["X-Relay-Worker"] == str(worker) and got.headers["X-Relay-Steps"] == "2"
    again = agg.app.get("/v1/blocks/0/streams", headers=auth(agg.token, 5))
    assert again.status_code == 204, "a taker never gets a stream twice (while the block runs)"


def test_workers_of_a_relay_run_train_every_block_on_the_streams_before(agg, corpus, tmp_path):
    """One worker a block, one after another: block 0's trains its 3 rounds and relays its
    streams; block 1's trains on them (the newest first, then, block 0 being done, the newest
    again) and relays its own; block 2's trains on block 1's. Every update is accepted."""
    data = load_split(str(corpus), "train")

    def make(reg, config):
        cfg = RunConfig.from_dict(config["run_config"])
        return local_trainer(
            cfg,
            "block",
            reg.block,
            data,
            data_seed=reg.data_seed,
            spool=tmp_path / f"spool{reg.block}",
        )

    reports = []
    for block in range(3):
        loop = WorkerLoop(agg.client(), make, block=block, spool=tmp_path / f"in{block}")
        reports.append(loop.run())
    for block, report in enumerate(reports):
        assert report.stopped_by == "done" and report.accepted == 3, (block, report)
    assert reports[2].bytes_stream_up == 0 and reports[0].bytes_stream_down == 0
    assert reports[1].bytes_stream_down > 0 and reports[2].bytes_stream_down > 0
    step = 4 * 16 * (32 + 5)
    assert len(agg.streams_pushed) == 6 and all(
        2 * step < n < 2 * step + 4096 for n in agg.streams_pushed
    )
    versions = [agg.app.app.state.service.blocks[b].rounds.version for b in range(3)]
    assert versions == [3, 3, 3]
