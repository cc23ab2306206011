"""Issue 30, "a worker that resumes": the aggregator takes a worker back (`POST /v1/workers`
with `resume_worker_id`) from the token that owns it, whether the worker left or timed out, on
its block and under its id, so with its data seed; another token, an id never given, a revoked
or banned token are refused. Before, a restarted worker always came back as a new worker (a new
id, so a new data seed)."""

from __future__ import annotations

import json
import random

from blocktrain.protocol.store.storage import MANIFEST, StateDir
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.loop import WorkerLoop
from tests.protocol.conftest import SETTINGS, Harness, auth, make_state
from tests.protocol.service.test_directory import pair  # noqa: F401  (a fixture)
from tests.protocol.worker.test_worker import FakeTrainer


def resume(h: Harness, token: str, worker: int, **body: object):
    return h.client.post(
        "/v1/workers", json={"resume_worker_id": worker, **body}, headers=auth(token)
    )


def leave(h: Harness, token: str, worker: int) -> None:
    r = h.client.delete(f"/v1/workers/{worker}", headers=auth(token, worker))
    assert r.status_code == 200, r.text


def test_a_token_takes_back_its_worker_that_left(harness):
    h = harness
    first = h.register(h.alice, block=1)
    assert first["resumed"] is False
    leave(h, h.alice, first["worker_id"])
    r = resume(h, h.alice, first["worker_id"])
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["resumed"] is True
    for key in ("worker_id", "block", "data_seed", "local_steps"):
        assert doc[key] == first[key], key
    assert doc["run_id"] == h.client.get("/v1/config", headers=auth(h.alice)).json()["run_id"]
    (row,) = h.state.ledger.workers(active_only=False)
    assert row.id == first["worker_id"] and row.left_at is None, "no second row: the same worker"
    assert h.pull(h.alice, row.id, 1).status_code == 200
    shown = h.client.get("/v1/status", headers=auth(h.alice)).json()["workers"]["list"]
    assert [(w["worker_id"], w["state"]) for w in shown] == [(row.id, "live")]


def test_a_worker_that_timed_out_or_is_still_registered_comes_back(harness):
    h = harness
    first = h.register(h.alice, block=0)["worker_id"]
    h.clock.advance(SETTINGS.live_window + 1)  # timed out: registered, not heard from
    status = h.client.get("/v1/status", headers=auth(h.alice)).json()["workers"]["list"]
    assert [w["state"] for w in status] == ["timed_out"]
    again = resume(h, h.alice, first).json()
    assert (again["worker_id"], again["block"]) == (first, 0)
    # still registered (a worker killed without a goodbye, back before it timed out): at one
    # worker per token, taking it back does not retire it for itself
    assert resume(h, h.alice, first).json()["worker_id"] == first
    assert [w.id for w in h.state.ledger.workers()] == [first]
    assert h.service.engine.registry.workers_of(h.state.ledger.workers()[0].token_id) == [first]
    assert h.service.blocks[0].rounds.assigned == {first}


def test_taking_a_worker_back_retires_the_tokens_newer_one(harness):
    """A token at its max_workers_per_token (1) that takes an old worker back retires the newer
    one, as a new registration retires the oldest."""
    h = harness
    old = h.register(h.alice, block=0)["worker_id"]
    new = h.register(h.alice, block=1)["worker_id"]  # retires `old`
    assert resume(h, h.alice, old).json()["block"] == 0
    assert [w.id for w in h.state.ledger.workers()] == [old]
    assert h.pull(h.alice, new, 1).json()["reason"] == "unknown_worker"


def test_only_its_own_token_may_take_a_worker_back_unless_shut_out(harness):
    h = harness
    mine = h.register(h.alice, block=1)["worker_id"]
    leave(h, h.alice, mine)
    r = resume(h, h.bob, mine)
    assert r.status_code == 403 and r.json()["reason"] == "not_your_worker", r.text
    (row,) = h.state.ledger.workers(active_only=False)
    assert row.left_at is not None, "a refusal leaves the worker as it was"
    r = resume(h, h.alice, 99)
    assert r.status_code == 404 and r.json()["reason"] == "unknown_worker"
    r = resume(h, h.alice, mine, block=0)
    assert r.status_code == 403 and r.json()["reason"] == "not_assigned"
    assert "trains block 1" in r.json()["detail"]
    r = resume(h, h.alice, -1)
    assert r.status_code == 422 and r.json()["reason"] == "bad_request"
    assert resume(h, h.alice, mine, block=1).json()["worker_id"] == mine
    # a revoked or banned token is refused as for any call, before its body is read
    leave(h, h.alice, mine)
    h.state.ledger.ban_token("bob", 1.0, "sign flips")
    r = resume(h, h.bob, mine)
    assert (r.status_code, r.json()["reason"]) == (403, "banned_token")
    h.state.ledger.revoke_token("alice", 1.0)
    r = resume(h, h.alice, mine)
    assert (r.status_code, r.json()["reason"]) == (401, "invalid_token")
    assert h.state.ledger.workers() == [], "the worker stays gone"


def test_the_run_id_is_made_with_the_state_and_kept(tmp_path):
    state = make_state(tmp_path / "a")
    run_id = state.run_id()
    assert len(run_id) == 32 and run_id != make_state(tmp_path / "b").run_id()
    state.write_manifest(  # as `aggregator` does when flags replace settings at a restart
        run_config=state.run_config(), settings=SETTINGS.replace(deadline_s=9), n_blocks=2
    )
    state.save_placement([0, 1], {})
    assert StateDir(tmp_path / "a").run_id() == run_id
    # a folder written before the run id gets one the first time it is asked, and keeps it
    path = tmp_path / "a" / MANIFEST
    doc = json.loads(path.read_text())
    del doc["run_id"]
    path.write_text(json.dumps(doc))
    given = StateDir(tmp_path / "a").run_id()
    assert given != run_id and StateDir(tmp_path / "a").run_id() == given
    state.close()


def test_a_worker_resumes_at_the_aggregator_of_its_block(pair, tmp_path):  # noqa: F811
    """One aggregator per block, over loopback: a worker started at A for block 1 follows the
    directory to B; restarted at A with its folder and no --block, it goes back to B and comes
    back there as the same worker."""
    from blocktrain.protocol.worker.resume import WorkerFolder  # here: the other tests run without

    (a, b), (token, _), states = pair
    folder_dir = tmp_path / "w"
    client = AggregatorClient(a, token, rng=random.Random(0))
    folder = WorkerFolder(folder_dir, a, block=1)
    first = WorkerLoop(client, lambda reg, cfg: FakeTrainer(), block=1, max_rounds=1, folder=folder)
    report = first.run()
    folder.close()
    client.close()
    assert report.stopped_by == "max_rounds" and report.block == 1
    saved = json.loads((folder_dir / "worker.json").read_text())
    assert (saved["aggregator"], saved["served_by"], saved["round"]) == (a, b, 0)
    assert saved["run_id"] == states[1].run_id() != states[0].run_id()

    lines: list[str] = []
    client = AggregatorClient(a, token, rng=random.Random(0))
    folder = WorkerFolder(folder_dir, a)
    again = WorkerLoop(client, lambda reg, cfg: FakeTrainer(), folder=folder, say=lines.append)
    report = again.run()
    folder.close()
    assert client.base_url == b and report.worker_id == saved["worker_id"]
    assert report.stopped_by == "done" and report.rounds == 2, "rounds 1 and 2: round 0 was done"
    assert f"resumed worker {saved['worker_id']} from {folder_dir}: after round 0" in lines[1]
    assert [w.id for w in states[1].ledger.workers(active_only=False)] == [saved["worker_id"]]
    assert states[0].ledger.workers(active_only=False) == []
    client.close()
