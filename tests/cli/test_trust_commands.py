"""`blocktrain token add --block`, `blocktrain ban` and `blocktrain rollback`: what they write,
and one clear line with exit code 2 for every bad input."""

from __future__ import annotations

import json
import os

from blocktrain.cli.main import main
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token
from tests.protocol.conftest import delta_body, make_harness, make_state

from .test_cli import fails_cleanly


def test_token_add_pins_blocks_and_list_shows_them(tmp_path, capsys):
    state = make_state(tmp_path / "agg")  # two blocks
    state.close()
    root = str(tmp_path / "agg")
    assert main(["token", "add", "bob", "--state", root, "--block", "1"]) == 0
    token = capsys.readouterr().out.strip()
    s = StateDir(tmp_path / "agg")
    row = s.ledger.token_by_hash(hash_token(token))
    assert row is not None and row.name == "bob" and row.blocks == (1,)
    s.close()
    assert main(["token", "list", "--state", root, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["blocks"] == [1] and listed["banned"] is None
    fails_cleanly(capsys, ["token", "add", "c", "--state", root, "--block", "2"], "--block 2")
    fails_cleanly(capsys, ["token", "add", "c", "--name", "d", "--state", root], "give the name")
    fails_cleanly(capsys, ["token", "add", "--state", root], "NAME (or --name)")


def test_ban_refuses_the_token_for_good(tmp_path, capsys):
    h = make_harness(tmp_path / "agg")
    w = h.register(h.alice, block=0)["worker_id"]
    root = str(tmp_path / "agg")
    assert main(["ban", root, "alice", "--reason", "sign flips"]) == 0
    assert capsys.readouterr().out.strip() == "banned alice"
    h.service.tick()
    r = h.pull(h.alice, w, 0)
    assert r.status_code == 403 and r.json()["reason"] == "banned_token"
    assert "sign flips" in r.json()["detail"]
    r = h.client.post("/v1/workers", json={}, headers={"Authorization": f"Bearer {h.alice}"})
    assert r.status_code == 403 and r.json()["reason"] == "banned_token"
    assert main(["token", "list", "--state", root, "--json"]) == 0
    alice = json.loads(capsys.readouterr().out)[0]
    assert alice["banned"] is not None and alice["revoked"] is not None
    assert alice["ban_reason"] == "sign flips"
    fails_cleanly(capsys, ["ban", root, "alice"], "already banned")
    fails_cleanly(capsys, ["ban", root, "nobody"], "no token named")
    fails_cleanly(capsys, ["ban", str(tmp_path / "none"), "alice"], "holds no aggregator ledger")
    h.state.close()


def test_rollback_command(tmp_path, capsys):
    h = make_harness(tmp_path / "agg")
    w = h.register(h.alice, block=1)["worker_id"]
    for v in range(2):
        h.pull(h.alice, w, 1)
        assert h.push(h.alice, w, 1, delta_body(1, base_version=v, round=v)).status_code == 200
    h.service.tick()
    h.state.close()
    root = str(tmp_path / "agg")
    assert main(["rollback", root, "--block", "1", "--to-version", "1", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert (done["from_version"], done["to_version"], done["new_version"]) == (2, 1, 3)
    assert main(["rollback", root, "--block", "1", "--to-version", "0"]) == 0
    assert "version 0 is now version 4" in capsys.readouterr().out
    fails_cleanly(capsys, ["rollback", root, "--block", "1", "--to-version", "4"], "not an earlier")
    fails_cleanly(capsys, ["rollback", root, "--block", "7", "--to-version", "0"], "outside 0..1")
    state = StateDir(tmp_path / "agg")
    state.write_endpoint("http://127.0.0.1:9", os.getpid())
    state.close()
    fails_cleanly(
        capsys, ["rollback", root, "--block", "1", "--to-version", "0"], "stop it, roll back"
    )
    fails_cleanly(
        capsys,
        ["rollback", str(tmp_path / "none"), "--block", "0", "--to-version", "0"],
        "holds no aggregator state",
    )


def test_token_add_viewer_makes_a_token_that_only_watches(tmp_path, capsys):
    h = make_harness(tmp_path / "agg")
    root = str(tmp_path / "agg")
    assert main(["token", "add", "screen", "--state", root, "--viewer"]) == 0
    token = capsys.readouterr().out.strip()
    headers = {"Authorization": f"Bearer {token}"}
    assert h.client.get("/v1/status", headers=headers).status_code == 200
    r = h.client.post("/v1/workers", json={}, headers=headers)
    assert r.status_code == 403 and r.json()["reason"] == "viewer_token"
    assert main(["token", "list", "--state", root, "--json"]) == 0
    listed = {t["name"]: t["viewer"] for t in json.loads(capsys.readouterr().out)}
    assert listed == {"alice": False, "bob": False, "screen": True}
    assert main(["token", "list", "--state", root]) == 0
    assert "none (viewer)" in capsys.readouterr().out
    fails_cleanly(
        capsys, ["token", "add", "x", "--state", root, "--viewer", "--block", "0"], "not both"
    )
    h.state.close()
