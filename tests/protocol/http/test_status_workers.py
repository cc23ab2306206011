"""What `/v1/status` says of workers that are gone and of a finished run (issue 30: workers that
exited stayed `live yes`, and there was no "done" marker): a worker that left is listed as
`left`, one not heard from within the live window as `timed_out`, neither as live; `done` turns
true when every block has finished its rounds; `blocktrain status` shows the same."""

from __future__ import annotations

from blocktrain.cli.status import render
from tests.protocol.conftest import SETTINGS, auth, delta_body, make_harness


def status(h) -> dict:
    r = h.client.get("/v1/status", headers=auth(h.alice))
    assert r.status_code == 200, r.text
    return r.json()


def by_id(s: dict) -> dict[int, dict]:
    return {w["worker_id"]: w for w in s["workers"]["list"]}


def test_workers_that_left_or_timed_out_are_not_live(tmp_path):
    h = make_harness(tmp_path / "s", SETTINGS.replace(live_window_s=100.0))
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=1)["worker_id"]
    h.clock.advance(10.0)
    gone = h.client.delete(f"/v1/workers/{a}", headers=auth(h.alice, a))
    assert gone.status_code == 200, gone.text
    h.clock.advance(5.0)
    s = status(h)
    left = by_id(s)[a]
    assert (left["live"], left["state"], left["left_s"]) == (False, "left", 5.0)
    assert left["block"] == 0 and left["last_seen_s"] == 15.0
    assert by_id(s)[b]["state"] == "live" and by_id(s)[b]["live"]
    assert (s["workers"]["registered"], s["workers"]["live"], s["workers"]["left"]) == (1, 1, 1)
    assert s["blocks"][0]["live_replicas"] == 0
    shown = render(s, rounds=1)
    assert f"worker {a} -: block 0, left 5s ago" in shown and "1 left" in shown

    h.clock.advance(100.0)  # bob is not heard from within the live window
    s = status(h)
    silent = by_id(s)[b]
    assert (silent["live"], silent["state"], silent["left_s"]) == (False, "timed_out", None)
    assert s["workers"]["live"] == 0
    assert "not live (timed out, last seen 115s ago)" in render(s, rounds=1)
    h.state.close()


def test_the_status_is_done_when_every_block_is(tmp_path):
    h = make_harness(tmp_path / "s", SETTINGS.replace(max_rounds=1))
    workers = {blk: h.register(h.alice if blk == 0 else h.bob, block=blk)["worker_id"]
               for blk in (0, 1)}  # fmt: skip
    for blk, w in workers.items():
        token = h.alice if blk == 0 else h.bob
        assert h.pull(token, w, blk).status_code == 200
        assert h.push(token, w, blk, delta_body(blk, worker=w)).status_code == 200
        s = status(h)
        assert s["blocks"][blk]["done"], "every expected replica reported: the round closed"
        assert s["done"] is (blk == 1), "done once every block is"
    assert "run done (every block finished its 1 round)" in render(s, rounds=1)
    assert "run done" not in render({**s, "done": False}, rounds=1)
    h.state.close()
