"""Issue 30, "a worker that resumes": with a folder (`WorkerFolder`, `blocktrain worker --state
DIR`) a worker keeps its registration, optimizer state and error-feedback residual after each
push; killed and started again with the folder it comes back as the same worker (id, data seed)
and sends the update an uninterrupted worker would have sent. Before, a restarted worker came
back as a new worker with a fresh AdamW. A folder of another run or block is refused, with
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors import safe_open

from blocktrain.config import RunConfig
from blocktrain.data import load_split
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.protocol.core.bodies import decode
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.loop import WorkerLoop
from blocktrain.protocol.worker.resume import WorkerFolder
from blocktrain.training.local import local_trainer
from tests.asgi import answered_by
from tests.conftest import micro_config
from tests.protocol.conftest import FakeClock, make_harness, run_state
from tests.protocol.worker.test_worker import SETTINGS, FakeTrainer, client_for, distinct_delta


class Killed(Exception):
    """Stands in for SIGKILL: the loop ends at once, without a goodbye."""


class MomentTrainer(FakeTrainer):
    """A FakeTrainer with an optimizer state that changes as it trains."""

    def __init__(self, on_train=None) -> None:
        super().__init__(on_train)
        self.moments = torch.zeros(3)
        self.before: list[torch.Tensor] = []
        """The moments as each round's training found them."""
        self.steps_done = 0

    def train(self, steps, first_step, should_stop):
        self.before.append(self.moments.clone())
        self.moments = self.moments * 0.9 + first_step + 1
        self.steps_done += steps
        return super().train(steps, first_step, should_stop)  # then the on_train hook

    def delta(self):  # by the step trained from: a resumed trainer's first is not round 0's
        return distinct_delta(self.loaded[-1], self.first_steps[-1] + 1)

    def optimizer_state(self):
        return {"w.exp_avg": self.moments.clone()}

    def load_optimizer_state(self, tensors, steps_done=0):
        self.moments = tensors["w.exp_avg"].clone()
        self.steps_done = steps_done


@pytest.fixture
def h(tmp_path):
    harness = make_harness(tmp_path / "s", SETTINGS.replace(delta_wire="int8"))
    yield harness
    harness.state.close()


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def run(h, folder_dir: Path, trainer, token=None, **kwargs):
    folder = WorkerFolder(folder_dir, "http://agg", block=kwargs.get("block"))
    try:
        loop = WorkerLoop(
            client_for(h, token or h.alice), lambda r, c: trainer, folder=folder, **kwargs
        )
        return loop, loop.run()
    finally:
        folder.close()


def test_the_folder_holds_the_registration_optimizer_and_residual(h, tmp_path):
    trainer = MomentTrainer()
    _, report = run(h, tmp_path / "w", trainer, block=1, max_rounds=2)
    assert report.rounds == 2
    doc = json.loads((tmp_path / "w" / "worker.json").read_text())
    assert doc["format"] == "blocktrain-worker" and doc["aggregator"] == "http://agg"
    assert (doc["worker_id"], doc["block"], doc["round"], doc["steps_done"]) == (0, 1, 1, 6)
    assert doc["data_seed"] == 5 * SETTINGS.n_workers and doc["delta_wire"] == "int8"
    assert doc["run_id"] == h.service.run_id and len(doc["run"]) == 16
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "state.safetensors",
        "worker.json",
    ], "two files, no temporaries, nothing pickled"
    with safe_open(str(tmp_path / "w" / "state.safetensors"), framework="pt") as f:
        meta, keys = f.metadata(), sorted(f.keys())
        assert torch.equal(f.get_tensor("optimizer/w.exp_avg"), trainer.moments)
    assert meta["round"] == "1" and meta["block"] == "1" and meta["delta_wire"] == "int8"
    names = ["embed", "layer.bias", "layer.weight"]
    assert keys == [
        "optimizer/w.exp_avg",
        *(f"residual/{n}" for n in names),  # the int8 pushes' error feedback
        *(f"view/{n}" for n in names),  # the weights as pulled: the next pull is a delta
    ]
    assert meta["view_version"] == meta["version"] == "1", "the view round 1 trained from"


def test_a_worker_killed_and_restarted_comes_back_where_it_stopped(h, tmp_path):
    """Killed (no goodbye) while training round 2, then started with its folder: the same worker
    id and data seed, the optimizer state and residual of round 1, and it waits past round 1
    (no duplicate): its round-2 push is accepted and the block runs to its end."""
    seen: dict = {}

    def kill(n: int) -> None:
        if n == 3:
            seen["moments"] = first.moments.clone()
            seen["residual"] = {k: v.clone() for k, v in loop._encoder.residual.items()}
            raise Killed

    first = MomentTrainer(on_train=kill)
    folder = WorkerFolder(tmp_path / "w", "http://agg", block=0)
    loop = WorkerLoop(client_for(h, h.alice), lambda r, c: first, block=0, folder=folder)
    with pytest.raises(Killed):
        loop.run()
    folder.close()
    (row,) = h.state.ledger.workers(active_only=False)
    assert row.left_at is None, "no goodbye"

    second = MomentTrainer()
    restored: dict = {}

    def check(n: int) -> None:
        if n == 1:
            restored["residual"] = {k: v.clone() for k, v in resumed._encoder.residual.items()}

    second.on_train = check
    lines: list[str] = []
    folder = WorkerFolder(tmp_path / "w", "http://agg")
    resumed = WorkerLoop(
        client_for(h, h.alice), lambda r, c: second, folder=folder, say=lines.append
    )
    report = resumed.run()
    folder.close()
    assert report.worker_id == row.id and report.stopped_by == "done"
    assert lines[0].startswith(f"worker {row.id} on block 0 (data seed {5 * SETTINGS.n_workers},")
    assert lines[1] == (
        f"resumed worker {row.id} from {tmp_path / 'w'}: after round 1, AdamW state of 6 local "
        "steps, the error-feedback residual"
    )
    # the moments as they were after round 1, before the killed round's training moved them
    moments_after_round_1 = (torch.zeros(3) * 0.9 + 0 + 1) * 0.9 + 3 + 1
    assert torch.equal(second.before[0], moments_after_round_1)
    assert not torch.equal(seen["moments"], moments_after_round_1), "round 2 had moved them"
    assert restored["residual"].keys() == seen["residual"].keys()
    assert all(torch.equal(restored["residual"][k], seen["residual"][k]) for k in seen["residual"])
    assert second.first_steps == [6, 9], "rounds 2 and 3, from versions 2 and 3"
    assert report.accepted == 2 and report.refused == {}, "no duplicate of round 1"
    assert [w.id for w in h.state.ledger.workers(active_only=False)] == [row.id]
    assert h.service.blocks[0].rounds.version == 4


def test_a_folder_of_another_run_is_refused_and_left_as_it_was(h, tmp_path):
    run(h, tmp_path / "w", MomentTrainer(), block=0, max_rounds=1)
    before = files(tmp_path / "w")
    other = make_harness(tmp_path / "s2", SETTINGS)  # same config, another state folder: its run
    try:
        folder = WorkerFolder(tmp_path / "w", "http://agg")
        loop = WorkerLoop(
            client_for(other, other.alice), lambda r, c: MomentTrainer(), folder=folder
        )
        with pytest.raises(ConfigError, match=r"belongs to another run \(run [0-9a-f]+ at "):
            loop.run()
        folder.close()
        assert files(tmp_path / "w") == before, "nothing written"
        assert other.state.ledger.workers(active_only=False) == [], "nothing registered"
    finally:
        other.state.close()


def test_another_block_another_token_and_fresh(h, tmp_path):
    run(h, tmp_path / "w", MomentTrainer(), block=0, max_rounds=1)
    before = files(tmp_path / "w")
    with pytest.raises(ConfigError, match="holds worker 0 of block 0, not block 1: drop --block"):
        WorkerFolder(tmp_path / "w", "http://agg", block=1)
    with pytest.raises(ProtocolError, match=r"cannot resume worker 0 .*written with another token"):
        run(h, tmp_path / "w", MomentTrainer(), token=h.bob)
    assert files(tmp_path / "w") == before
    # --fresh: a new worker, whose registration replaces the folder's
    folder = WorkerFolder(tmp_path / "w", "http://agg", fresh=True)
    assert folder.saved is None
    loop = WorkerLoop(client_for(h, h.alice), lambda r, c: MomentTrainer(), folder=folder, block=1)
    loop.max_rounds = 1
    report = loop.run()
    folder.close()
    assert report.worker_id == 1
    assert json.loads((tmp_path / "w" / "worker.json").read_text())["worker_id"] == 1


def test_the_folder_is_locked_and_must_be_a_workers(h, tmp_path):
    folder = WorkerFolder(tmp_path / "w", "http://agg")
    with pytest.raises(ConfigError, match="in use by another worker"):
        WorkerFolder(tmp_path / "w", "http://agg")
    folder.close()
    assert not (tmp_path / "w").exists(), "a folder made and never written is removed"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"not a worker's \(notes.txt\)"):
        WorkerFolder(tmp_path / "mine", "http://agg")
    with pytest.raises(ConfigError, match="an aggregator's state folder"):
        WorkerFolder(h.state.root, "http://agg")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "worker.json").write_text("{")
    with pytest.raises(ConfigError, match=r"worker\.json is unreadable .*--fresh"):
        WorkerFolder(tmp_path / "bad", "http://agg")


# ------------------------------------------------------------------ with the real trainer


class Aggregator:
    """A real run's aggregator (micro shape) in this process, recording every push body."""

    def __init__(self, root: Path, wire: str) -> None:
        settings = {"deadline_s": 30.0, "local_steps": 2, "min_round_s": 0.0, "max_rounds": 3}
        self.state = run_state(root, micro_config("features"), {**settings, "delta_wire": wire})
        self.token = new_token()
        self.state.ledger.add_token("alice", hash_token(self.token), 0.0)
        self.app = TestClient(
            create_app(storage=self.state, clock=FakeClock()), base_url="http://agg"
        )
        self.app.__enter__()
        self.pushes: list[bytes] = []
        self.pulls: list[tuple[str, int]] = []
        """(path, status) of each download of a version, whole or as a delta."""

    def client(self) -> AggregatorClient:
        def handler(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.path.endswith("/updates"):
                self.pushes.append(request.content)
            r = answered_by(self.app, request)
            if "/versions/" in request.url.path:
                self.pulls.append((request.url.path, r.status_code))
            return r

        return AggregatorClient("http://agg", self.token, transport=httpx.MockTransport(handler))

    def close(self) -> None:
        self.app.__exit__(None, None, None)
        self.state.close()


def trainers(data, kill_at: int | None = None):
    def make(reg, config):
        cfg = RunConfig.from_dict(config["run_config"])
        trainer = local_trainer(cfg, "block", reg.block, data, data_seed=reg.data_seed)
        if kill_at is not None:
            calls = [0]
            train = trainer.train

            def killed(steps, first_step, should_stop):
                calls[0] += 1
                if calls[0] == kill_at:
                    train(1, first_step, should_stop)  # a step of the round, then the kill
                    raise Killed
                return train(steps, first_step, should_stop)

            trainer.train = killed  # type: ignore[method-assign]
        return trainer

    return make


def tensors_of(body: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    decoded = decode(body)
    meta = {k: v for k, v in decoded.metadata.items() if k != "worker_id"}
    return meta, decoded.to_torch()


@pytest.mark.parametrize("wire", ["fp16", "int8"])
def test_a_restarted_worker_sends_the_update_an_uninterrupted_one_sends(tmp_path, corpus, wire):
    """Two identical runs: in one the worker trains the 3 rounds through; in the other it is
    killed one local step into round 2 and started again (a new process: a new trainer, a new
    client) with its folder. Its round-2 update is the uninterrupted worker's, tensor for
    tensor (with int8, the error-feedback residual of rounds 0-1 is in it); a worker started
    afresh instead sends another."""
    data = load_split(str(corpus), "train")
    through, killed, fresh = (Aggregator(tmp_path / n, wire) for n in ("a", "b", "c"))
    try:
        report = WorkerLoop(through.client(), trainers(data), block=1).run()
        assert report.stopped_by == "done" and report.accepted == 3

        folder = WorkerFolder(tmp_path / "w", "http://agg", block=1)
        with pytest.raises(Killed):
            WorkerLoop(killed.client(), trainers(data, kill_at=3), block=1, folder=folder).run()
        folder.close()
        folder = WorkerFolder(tmp_path / "w", "http://agg")
        before = len(killed.pulls)
        report = WorkerLoop(killed.client(), trainers(data), folder=folder).run()
        folder.close()
        assert report.stopped_by == "done" and report.accepted == 1 and report.rounds == 1
        # with int8 pulls are deltas from the view held: the restarted worker's one is too, from
        # the view its folder kept (a whole pull would train from other weights)
        (path, status), *_ = killed.pulls[before:]
        assert path.endswith("/delta" if wire == "int8" else "/versions/2") and status == 200
        assert len(killed.pushes) == len(through.pushes) == 3

        for want, got in zip(through.pushes, killed.pushes, strict=True):
            (meta_a, a), (meta_b, b) = tensors_of(want), tensors_of(got)
            assert meta_a == meta_b and a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(b[k].float(), a[k].float(), atol=1e-6, rtol=0)

        # the control: a worker that starts afresh at round 2 sends another update
        WorkerLoop(fresh.client(), trainers(data), block=1, max_rounds=2).run()
        WorkerLoop(fresh.client(), trainers(data), block=1).run()
        _, a = tensors_of(through.pushes[2])
        _, c = tensors_of(fresh.pushes[2])
        assert any(not torch.allclose(a[k].float(), c[k].float(), atol=1e-6) for k in a)
    finally:
        for agg in (through, killed, fresh):
            agg.close()
