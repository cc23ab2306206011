"""The aggregator's live evaluation (issue 30, "Plots that tell the truth": the validation CE of
the assembled model appeared only after a cluster's rounds): with `live_eval_every` = N the model
after R rounds (every block's version after its R-th round) is evaluated for R = 0, each
multiple of N and the last of max_rounds, in the background; the records persist in
STATE/evals.jsonl across a restart and reach `/v1/history`, the dashboard and the report.
A real micro model on a 64-byte slice: each evaluation takes milliseconds."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from blocktrain.data import ByteCorpus
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.ops.report import panels
from blocktrain.protocol.store.history import load
from blocktrain.protocol.store.storage import EVALS, StateDir
from blocktrain.training.live_eval import AssembledEval
from blocktrain.training.local import initial_blocks
from tests.conftest import micro_config
from tests.protocol.conftest import FakeClock, add_token, auth, delta_body, run_state

OVERRIDES = {
    "effect_probe": "off",
    "live_eval_every": 2,
    "max_rounds": 3,
    "live_eval_bytes": 64,
    "quorum": 1.0,
    "min_round_s": 0.0,
    "replay_rounds": 0,
}


class Run:
    """An aggregator app of a micro run with its evaluator, one worker per block."""

    def __init__(self, root: Path, corpus: Path) -> None:
        self.cfg = micro_config()
        self.root = root
        self.evaluator = AssembledEval(
            self.cfg, "block", ByteCorpus.open(corpus).split("valid"), 64, 1
        )
        self.clock = FakeClock()
        state = run_state(root, self.cfg, OVERRIDES)
        self.tokens = [add_token(state, f"w{b}") for b in range(self.cfg.model.blocks)]
        self.open(state)
        self.workers = [
            self.client.post("/v1/workers", json={"block": b}, headers=auth(t)).json()["worker_id"]
            for b, t in enumerate(self.tokens)
        ]
        self.version = [0] * self.cfg.model.blocks
        self.shapes = {
            b: {k: w.shape for k, w in t.items()} for b, t in initial_blocks(self.cfg).items()
        }

    def open(self, state: StateDir) -> None:
        self.state = state
        app = create_app(storage=state, clock=self.clock, evaluator=self.evaluator)
        self.client = TestClient(app, base_url="http://agg")
        self.service = app.state.service

    def restart(self) -> None:
        self.service.close()
        self.state.close()
        self.open(StateDir(self.root))

    def close(self) -> None:
        self.service.close()
        self.state.close()

    def round(self, block: int) -> None:
        """Block `block` closes its open round with one accepted update."""
        token, worker, v = self.tokens[block], self.workers[block], self.version[block]
        headers = auth(token, worker)
        assert self.client.get(f"/v1/blocks/{block}", headers=headers).status_code == 200
        gen = torch.Generator().manual_seed(100 * block + v)
        delta = {
            k: 1e-2 * torch.randn(shape, generator=gen) for k, shape in self.shapes[block].items()
        }
        body = delta_body(
            block, base_version=v, round=v, worker=worker, tensors=delta, loss=3.0 - 0.1 * v
        )
        r = self.client.post(f"/v1/blocks/{block}/updates", content=body, headers=headers)
        assert r.status_code == 200, r.text
        self.clock.advance(1.0)
        self.service.tick()
        self.version[block] += 1

    def drain(self) -> list[dict]:
        assert self.service.evaluations.drain(30.0)
        return self.state.evals()


def test_the_model_after_r_rounds_is_evaluated_at_0_each_multiple_and_the_last(tmp_path, corpus):
    run = Run(tmp_path / "state", corpus)
    try:
        (initial,) = run.drain()  # R = 0 at the first start: the initial model
        assert initial["rounds"] == 0 and initial["versions"] == {"0": 0, "1": 0, "2": 0}
        assert initial["at"] is None and initial["bytes"] == 64 and initial["sweeps"] == 1
        run.round(0)
        run.round(0)  # block 0 after 2 rounds; blocks 1 and 2 after none: not complete yet
        run.round(1)
        run.round(2)  # R = 1 is no multiple of 2
        assert [r["rounds"] for r in run.drain()] == [0]

        run.restart()  # block 0's version after round 2 waits on disk
        run.round(0)  # block 0 after 3 rounds, 1 and 2 after 1
        run.round(1)
        run.round(2)  # every block after 2 rounds: evaluated, block 0 at its version 2
        run.round(1)
        run.round(2)  # the last of max_rounds = 3
        records = run.drain()
        assert [r["rounds"] for r in records] == [0, 2, 3]
        two, three = records[1], records[2]
        assert two["versions"] == {"0": 2, "1": 2, "2": 2}
        assert three["versions"] == {"0": 3, "1": 3, "2": 3}
        for record in (two, three):  # exactly the model of those versions, as on disk
            blocks = {
                int(b): run.state.load_tensors(int(b), v) for b, v in record["versions"].items()
            }
            expected = run.evaluator(blocks)
            assert record["from_noise_ce"] == expected["from_noise_ce"]
            assert record["from_noise_ce"] != initial["from_noise_ce"]
        # when the model was complete: block 2's commit of its round 1, then of its round 2
        # (the push that completes a round closes it; each round() then moves the clock 1 s)
        assert (two["at"], three["at"]) == (run.clock.now - 3.0, run.clock.now - 1.0)
        assert three["evaluated_at"] >= three["at"] and three["eval_s"] >= 0

        run.restart()  # every due model is recorded: nothing is evaluated again
        assert run.drain() == records
        assert (run.root / EVALS).read_text().count("\n") == 3
    finally:
        run.close()


def test_history_dashboard_and_report_carry_the_live_evaluations(tmp_path, corpus):
    run = Run(tmp_path / "state", corpus)
    try:
        run.drain()
        for _ in range(2):
            for b in range(3):
                run.round(b)
        records = run.drain()
        assert [r["rounds"] for r in records] == [0, 2]
        body = run.client.get("/v1/history", headers=auth(run.tokens[0])).json()
        # M = 1: the sampler CE is the from-noise CE, shown once; spans of K = 2: the joint CE
        series, joint = body["evals"]
        assert series["label"].startswith("validation from-noise CE of the committed model, live")
        assert joint["label"].startswith("validation joint CE of the committed model, live")
        assert "64 bytes, M = 1" in series["label"]
        assert [(p["rounds"], p["ce"]) for p in series["points"]] == [
            (r["rounds"], r["from_noise_ce"]) for r in records
        ]
        assert series["points"][0]["time_s"] == 0.0 and series["points"][1]["time_s"] > 0
        assert body["curve"][-1]["rounds"] == 2  # the loss curve's axis: rounds closed

        page = run.client.get("/dashboard").text
        assert 'id="evals"' in page and "Validation CE per round" in page
        assert "h.evals" in page and "--set live_eval_every=0" in page

        hist = load(run.root)  # `blocktrain report` on the state folder
        assert hist.evals[series["label"]] == [(r["rounds"], r["from_noise_ce"]) for r in records]
        assert hist.evals[joint["label"]] == [(r["rounds"], r["joint_ce"]) for r in records]
        assert "validation CE (nats/byte)" in [y for y, _ in panels(hist)]
        cluster = tmp_path / "cluster"  # a cluster folder before its summary: the live ones
        cluster.mkdir()
        run.close()
        run.state.root.rename(cluster / "state")
        hist = load(cluster)
        assert list(hist.evals) == [series["label"], joint["label"]]
        assert (
            "the live evaluations are plotted" in dict(hist.facts)["validation CE after the rounds"]
        )
    finally:
        run.close()


class GatedEval:
    """A stand-in evaluator (a number of the weights, not a CE) that holds its first call
    until released, as a slow evaluation would."""

    bytes, sweeps = 8, 1

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[float] = []

    def __call__(self, blocks):
        self.release.wait(10.0)
        value = sum(float(w.sum()) for t in blocks.values() for w in t.values())
        self.seen.append(value)
        return {"from_noise_ce": value}


def test_a_model_that_finds_another_waiting_replaces_it(tmp_path):
    """The evaluator busy with the initial model while rounds 1, 2 and 3 complete: 1 and 2 are
    skipped (the curve skips points rather than lag), 3 is evaluated once the evaluator is free;
    pushes are answered meanwhile (the evaluation holds no lock they need)."""
    from tests.protocol.conftest import SETTINGS, make_state

    state = make_state(tmp_path / "state", SETTINGS.replace(live_eval_every=1))
    tokens = [add_token(state, f"w{b}") for b in range(2)]
    gate = GatedEval()
    app = create_app(storage=state, clock=FakeClock(), evaluator=gate)
    client, service = TestClient(app, base_url="http://agg"), app.state.service
    try:
        workers = [
            client.post("/v1/workers", json={"block": b}, headers=auth(t)).json()["worker_id"]
            for b, t in enumerate(tokens)
        ]
        for r in range(3):
            for b, (t, w) in enumerate(zip(tokens, workers, strict=True)):
                assert client.get(f"/v1/blocks/{b}", headers=auth(t, w)).status_code == 200
                body = delta_body(b, base_version=r, round=r, worker=w)
                assert client.post(
                    f"/v1/blocks/{b}/updates", content=body, headers=auth(t, w)
                ).is_success
        assert [st.rounds.round for st in service.blocks.values()] == [3, 3]
        assert service.evaluations.skipped == 2 and gate.seen == []
        gate.release.set()
        assert service.evaluations.drain(10.0)
        records = state.evals()
        assert [r["rounds"] for r in records] == [0, 3]
        assert [r["from_noise_ce"] for r in records] == gate.seen
        assert records[1]["versions"] == {"0": 3, "1": 3}
    finally:
        gate.release.set()
        service.close()
        state.close()
