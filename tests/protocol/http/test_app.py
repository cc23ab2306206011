"""The aggregator app in this process (FastAPI TestClient, virtual clock): the wire contract,
deadlines, the bad-input matrix, restarts, accounting, metrics."""

from __future__ import annotations

import io
import pickle
import random

import pytest
import torch

from blocktrain.protocol.core.bodies import decode
from blocktrain.protocol.core.settings import AggregatorSettings
from tests.protocol.conftest import (
    SETTINGS,
    Harness,
    add_token,
    auth,
    block_tensors,
    delta_body,
    make_harness,
)


def refusal_rows(h: Harness, reason: str) -> int:
    return sum(1 for u in h.state.ledger.updates(fate="refused") if u.reason == reason)


def two_on_block0(h: Harness) -> tuple[int, int]:
    a = h.register(h.alice, block=0)["worker_id"]
    b = h.register(h.bob, block=0)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    assert h.pull(h.bob, b, 0).status_code == 200
    return a, b


# ------------------------------------------------------------------------------ happy path


def test_register_assigns_blocks_evenly(harness):
    tokens = [harness.alice, harness.bob] + [add_token(harness.state, f"t{i}") for i in range(2)]
    blocks = [harness.register(token)["block"] for token in tokens]
    assert blocks == [0, 1, 0, 1]
    out = harness.register(harness.bob, block=1)
    assert out["block"] == 1 and out["data_seed"] == 5 * SETTINGS.n_workers + out["worker_id"]
    assert out["local_steps"] == 2 and out["wire_dtype"] == "fp16"


def test_pull_answers_safetensors_with_the_round_metadata(harness):
    w = harness.register(harness.alice, block=1)["worker_id"]
    r = harness.pull(harness.alice, w, 1)
    assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.safetensors"
    got = decode(r.content)
    md = got.metadata
    assert (md["block"], md["version"], md["round"]) == ("1", "0", "0")
    assert float(md["deadline"]) == pytest.approx(harness.clock.now + SETTINGS.deadline_s)
    assert float(r.headers["X-Deadline-In"]) == pytest.approx(SETTINGS.deadline_s)
    tensors = got.to_torch()
    for name, t in block_tensors(101).items():
        assert tensors[name].dtype == torch.float16, "weights travel in fp16 by default"
        assert torch.equal(tensors[name], t.half())


def test_round_with_every_replica_in_closes_early_with_the_identity_mean(harness):
    """Each token is one vote of equal weight; the tokens a push claims do not weight it
    (finding: the mean was weighted by self-reported token counts)."""
    h = harness
    a, b = two_on_block0(h)
    before = h.weights(0)
    ra = h.push(h.alice, a, 0, delta_body(0, tokens=300, scale=0.02))
    assert ra.status_code == 200 and ra.json()["accepted"] is True, ra.text
    assert h.service.blocks[0].rounds.round == 0, "one of two replicas in: still open"
    rb = h.push(h.bob, b, 0, delta_body(0, tokens=100, scale=-0.01))
    assert rb.status_code == 200, rb.text
    st = h.service.blocks[0].rounds
    assert st.round == 1 and st.version == 1, "all replicas in: closed before the deadline"
    d_a = torch.tensor(0.02, dtype=torch.float16).float()
    d_b = torch.tensor(-0.01, dtype=torch.float16).float()
    want = (d_a + d_b) / 2
    after = h.weights(0)
    for name in before:
        assert torch.allclose(after[name], before[name] + want, atol=1e-6), name
    (row,) = h.state.ledger.rounds(0)
    assert row["cause"] == "all_reported" and row["accepted"] == 2 and row["tokens"] == 400
    assert h.state.versions(0) == [0, 1]
    pulled = decode(h.pull(h.alice, a, 0).content)
    assert pulled.metadata["version"] == "1" and pulled.metadata["round"] == "1"


# ------------------------------------------------------------------------------ deadlines


def test_an_update_slower_than_the_deadline_is_refused_as_late(harness):
    h = harness
    a, b = two_on_block0(h)
    before = h.weights(0)
    h.clock.advance(5)
    assert h.push(h.alice, a, 0, delta_body(0, scale=0.02)).status_code == 200
    h.clock.advance(SETTINGS.deadline_s)  # bob is slower than the deadline
    r = h.push(h.bob, b, 0, delta_body(0, scale=0.5))
    assert r.status_code == 409, r.text
    assert r.json() == {"accepted": False, "reason": "late", "detail": r.json()["detail"]}
    (row,) = h.state.ledger.rounds(0)
    assert row["cause"] == "deadline" and row["accepted"] == 1
    assert row["closed_at"] == pytest.approx(h.clock.now), "closed when the deadline passed"
    d_a = torch.tensor(0.02, dtype=torch.float16).float()
    after = h.weights(0)
    for name in before:
        assert torch.allclose(after[name], before[name] + d_a, atol=1e-6), (
            "the late update is not in the new version"
        )
    assert refusal_rows(h, "late") == 1


def test_the_round_closes_at_the_deadline_without_any_request(harness):
    h = harness
    a, _ = two_on_block0(h)
    assert h.push(h.alice, a, 0, delta_body(0)).status_code == 200
    h.clock.advance(SETTINGS.deadline_s - 0.001)
    assert h.service.tick() == []
    h.clock.advance(0.001)
    (committed,) = h.service.tick()  # the app's background ticker calls this while serving
    closed = committed.closed
    assert closed.cause == "deadline" and closed.new_version == 1
    r = h.client.get("/v1/blocks/0/round", params={"after": 0}, headers=auth(h.alice))
    assert r.json()["round"] == 1 and r.json()["version"] == 1 and r.json()["deadline"] is None


def test_staleness_bound_accepts_a_late_update_down_weighted(tmp_path):
    h = make_harness(
        tmp_path / "s",
        AggregatorSettings(
            deadline_s=30,
            local_steps=2,
            max_delta_norm=50,
            max_tokens=10_000,
            min_round_s=0.0,
            replay_rounds=0,
            staleness=1,
            stale_weight=0.5,
        ),
    )
    a, b = two_on_block0(h)
    assert h.push(h.alice, a, 0, delta_body(0)).status_code == 200
    h.clock.advance(31)
    r = h.push(h.bob, b, 0, delta_body(0))
    assert r.status_code == 200 and r.json()["weight"] == 0.5 and r.json()["counts_in"] == 1
    h.state.close()


# ------------------------------------------------------------------------------ bad input


def _cases():
    good = {k: torch.full_like(v, 0.01) for k, v in block_tensors(100).items()}
    buf = io.BytesIO()
    torch.save(good, buf)
    body = delta_body(0)
    return [
        # (name, how, expected status, reason)
        ("no token", {"headers": {"Authorization": ""}}, 401, "missing_token"),
        ("wrong token", {"token": "bt_wrong"}, 401, "invalid_token"),
        ("revoked token", {"token": "revoked"}, 401, "invalid_token"),
        ("someone else's worker", {"worker": "bob"}, 403, "not_your_worker"),
        ("unregistered worker id", {"worker": 999}, 404, "unknown_worker"),
        ("block not assigned", {"block": 1, "body": delta_body(1)}, 403, "not_assigned"),
        ("unknown block", {"block": 7}, 404, "unknown_block"),
        ("stale version", {"body": delta_body(0, base_version=3)}, 409, "stale_version"),
        ("future round", {"body": delta_body(0, round=4)}, 409, "future_round"),
        (
            "missing tensor",
            {"body": delta_body(0, tensors={k: v for k, v in good.items() if k != "embed"})},
            400,
            "missing_tensors",
        ),
        (
            "extra tensor",
            {"body": delta_body(0, tensors={**good, "x": torch.zeros(2)})},
            400,
            "extra_tensors",
        ),
        (
            "wrong shape",
            {"body": delta_body(0, tensors={**good, "embed": torch.zeros(4, 5)})},
            400,
            "bad_shape",
        ),
        ("wrong dtype", {"body": delta_body(0, dtype="fp32")}, 400, "bad_dtype"),
        (
            "NaN",
            {"body": delta_body(0, tensors={**good, "embed": torch.full((5, 4), float("nan"))})},
            400,
            "non_finite",
        ),
        (
            "Inf",
            {"body": delta_body(0, tensors={**good, "layer.bias": torch.full((8,), float("inf"))})},
            400,
            "non_finite",
        ),
        ("norm over the bound", {"body": delta_body(0, scale=20.0)}, 400, "norm_too_large"),
        ("truncated body", {"body": body[: len(body) // 2]}, 400, "malformed"),
        ("not safetensors", {"body": b"just some text, not tensors"}, 400, "malformed"),
        ("empty body", {"body": b""}, 400, "malformed"),
        ("pickle", {"body": pickle.dumps(good)}, 415, "pickle"),
        ("torch.save", {"body": buf.getvalue()}, 415, "pickle"),
        ("over the size limit", {"body": b"\0" * (4096 + 1), "content": 1}, 413, "too_large"),
        ("over the limit, no length", {"stream": b"\0" * (4096 + 1)}, 413, "too_large"),
        ("negative tokens", {"body": delta_body(0, tokens=-3)}, 400, "bad_tokens"),
        ("zero tokens", {"body": delta_body(0, tokens=0)}, 400, "bad_tokens"),
        ("absurd tokens", {"body": delta_body(0, tokens=10**15)}, 400, "bad_tokens"),
        (
            "metadata without round",
            {"body": delta_body(0, tensors=None).replace(b'"round"', b'"rounx"')},
            400,
            "bad_metadata",
        ),
        ("metadata names another block", {"body": delta_body(1)}, 400, "bad_metadata"),
    ]


CASES = _cases()


@pytest.mark.parametrize(
    ("how", "status", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_refused_with_a_reason_and_a_ledger_row(tmp_path, how, status, reason):
    """Every refusal has its reason; those after the token is known have a ledger row, those before
    it (no or bad token, a declared size over the cap) are counted in memory only (an fsynced row
    for every refused push, even one without a token, would let anyone who can reach the port grow
    the ledger)."""
    h = make_harness(
        tmp_path / "s",
        AggregatorSettings(
            deadline_s=30,
            local_steps=2,
            max_delta_norm=50,
            max_tokens=10_000,
            min_round_s=0.0,
            replay_rounds=0,
            max_body_bytes=4096,
        ),
    )
    a = h.register(h.alice, block=0)["worker_id"]
    bob = h.register(h.bob, block=1)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    revoked = add_token(h.state, "carol")
    h.register(revoked, block=0)
    h.state.ledger.revoke_token("carol", 1.0)
    token = {"bt_wrong": "bt_wrong", "revoked": revoked}.get(how.get("token"), h.alice)
    worker = {"bob": bob}.get(how.get("worker"), how.get("worker", a))
    headers = {**auth(token, worker), **how.get("headers", {})}
    block = how.get("block", 0)
    before = {b: h.weights(b) for b in (0, 1)}
    rows_before = refusal_rows(h, reason)
    if "stream" in how:
        data = how["stream"]
        r = h.client.post(
            f"/v1/blocks/{block}/updates",
            headers=headers,
            content=(data[i : i + 1000] for i in range(0, len(data), 1000)),
        )
    else:
        r = h.client.post(
            f"/v1/blocks/{block}/updates", headers=headers, content=how.get("body", delta_body(0))
        )
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["accepted"] is False and doc["reason"] == reason and doc["detail"], doc
    for b in (0, 1):
        for name, t in before[b].items():
            assert torch.equal(h.weights(b)[name], t), f"weights of block {b} changed"
    unrecorded = reason.endswith("_token") or "content" in how
    assert refusal_rows(h, reason) == rows_before + (0 if unrecorded else 1), "ledger rows"
    assert h.service.traffic.refusals()["push"][reason] == 1, "counted in memory"
    assert h.state.pending_names() == [], "a refused body is not kept"
    h.state.close()


def test_stale_round_after_the_round_closed_is_late(harness):
    h = harness
    a = h.register(h.alice, block=0)["worker_id"]
    h.pull(h.alice, a, 0)
    assert h.push(h.alice, a, 0, delta_body(0)).status_code == 200  # closes round 0
    h.pull(h.alice, a, 0)
    r = h.push(h.alice, a, 0, delta_body(0, round=0, base_version=0))
    assert r.status_code == 409 and r.json()["reason"] == "late"
    r = h.push(h.alice, a, 0, delta_body(0, round=1, base_version=0))
    assert r.status_code == 409 and r.json()["reason"] == "stale_version"


def test_a_second_update_for_the_same_round_is_a_duplicate(harness):
    h = harness
    a, _ = two_on_block0(h)
    assert h.push(h.alice, a, 0, delta_body(0)).status_code == 200
    r = h.push(h.alice, a, 0, delta_body(0))
    assert r.status_code == 409 and r.json()["reason"] == "duplicate"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "bad_request"),
        (b'{"block": "one"}', "bad_request"),
        (b'{"block": -1}', "bad_request"),
        (b'{"bloc": 1}', "bad_request"),
        (b'{"block": 9}', "unknown_block"),
    ],
)
def test_bad_registrations(harness, body, reason):
    r = harness.client.post(
        "/v1/workers",
        content=body,
        headers={**auth(harness.alice), "Content-Type": "application/json"},
    )
    assert 400 <= r.status_code < 500 and r.json()["reason"] == reason, r.text


def test_every_call_but_metrics_and_docs_needs_a_token(harness):
    h = harness
    for method, path in (
        ("POST", "/v1/workers"),
        ("GET", "/v1/config"),
        ("GET", "/v1/blocks/0"),
        ("GET", "/v1/blocks/0/round"),
        ("POST", "/v1/blocks/0/updates"),
        ("GET", "/v1/status"),
        ("DELETE", "/v1/workers/0"),
    ):
        r = h.client.request(method, path)
        assert r.status_code == 401 and r.json()["reason"] == "missing_token", (path, r.text)
    assert h.client.get("/metrics").status_code == 200
    assert h.client.get("/docs").status_code == 200
    paths = h.client.get("/openapi.json").json()["paths"]
    for path in (
        "/v1/workers",
        "/v1/blocks/{block}",
        "/v1/blocks/{block}/updates",
        "/v1/status",
        "/metrics",
    ):
        assert path in paths


def test_revoking_a_token_takes_effect_at_once(harness):
    h = harness
    a = h.register(h.alice, block=0)["worker_id"]
    assert h.pull(h.alice, a, 0).status_code == 200
    h.state.ledger.revoke_token("alice", 2.0)
    r = h.pull(h.alice, a, 0)
    assert r.status_code == 401 and r.json()["reason"] == "invalid_token"


def test_malformed_requests_never_get_a_5xx(harness):
    h = harness
    rng = random.Random(0)
    a = h.register(h.alice, block=0)["worker_id"]
    h.pull(h.alice, a, 0)
    good = delta_body(0)
    paths = [
        "/v1/blocks/0/updates",
        "/v1/blocks/1/updates",
        "/v1/blocks/x/updates",
        "/v1/blocks/-1/updates",
        "/v1/workers",
        "/v1/blocks/0",
        "/v1/blocks/0/round",
        "/v1/status",
        "/v1/config",
        "/v1/workers/abc",
        "/nope",
    ]
    for i in range(150):
        kind = i % 5
        if kind == 0:
            body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        elif kind == 1:
            cut = rng.randint(0, len(good))
            body = good[:cut]
        elif kind == 2:
            flip = bytearray(good)
            for _ in range(rng.randint(1, 20)):
                flip[rng.randrange(len(flip))] = rng.getrandbits(8)
            body = bytes(flip)
        elif kind == 3:
            body = good.replace(b'"tokens":"100"', b'"tokens":"1e400"')
        else:
            body = b'{"block": ' + str(rng.randint(-5, 5)).encode() + b"}"
        headers = auth(rng.choice([h.alice, h.bob, "x", ""]), rng.choice([a, None, "z", -1]))
        method = rng.choice(["POST", "GET", "DELETE", "PUT"])
        r = h.client.request(method, rng.choice(paths), content=body, headers=headers)
        assert r.status_code < 500, (method, r.status_code, r.text)


# ------------------------------------------------------------------------------ restart


def test_restart_resumes_the_open_round_with_its_accepted_updates(harness):
    h = harness
    a, b = two_on_block0(h)
    assert h.push(h.alice, a, 0, delta_body(0, scale=0.03)).status_code == 200
    before = h.weights(0)
    h.service.tick()  # the app's ticker (every 0.1 s) writes the batched pull marks
    h2 = h.reopen()  # as if killed here: one accepted update, the round still open
    st = h2.service.blocks[0].rounds
    assert st.round == 0 and len(st.accepted) == 1 and st.expected() == {a, b}
    assert st.deadline == pytest.approx(h.service.blocks[0].rounds.deadline)
    r = h2.push(h2.bob, b, 0, delta_body(0, scale=0.01))
    assert r.status_code == 200, r.text
    assert st.round == 1, "the restored accepted update and the new one close the round"
    want = (
        torch.tensor(0.03, dtype=torch.float16).float()
        + torch.tensor(0.01, dtype=torch.float16).float()
    ) / 2
    for name, t in before.items():
        assert torch.allclose(h2.weights(0)[name], t + want, atol=1e-6)
    accepted = h2.state.ledger.updates(fate="accepted")
    assert len(accepted) == 2 and all(u.committed_version == 1 for u in accepted), (
        "no accepted update lost"
    )
    assert h2.state.pending_names() == []
    h2.state.close()


def test_restart_before_the_pull_marks_are_written_still_expects_every_worker(harness):
    """A crash before the ticker writes the batched pull marks loses them; the restored round
    must still wait for the other replica instead of closing on the first report."""
    h = harness
    a, b = two_on_block0(h)
    assert h.push(h.alice, a, 0, delta_body(0, scale=0.03)).status_code == 200
    h2 = h.reopen()  # no tick: the pulls of round 0 never reached the ledger
    st = h2.service.blocks[0].rounds
    assert st.expected() == {a, b}
    h2.service.tick()
    assert st.round == 0, "the round waits for bob"
    assert h2.push(h2.bob, b, 0, delta_body(0, scale=0.01)).status_code == 200
    assert st.round == 1
    assert all(u.committed_version == 1 for u in h2.state.ledger.updates(fate="accepted"))
    h2.state.close()


def test_status_says_why_the_rule_refused_to_aggregate(tmp_path):
    """A round whose rule refuses to aggregate (trimmed mean tolerating one attacker, two votes)
    commits no change; /v1/status and the ledger say why."""
    from dataclasses import replace

    h = make_harness(tmp_path / "s", replace(SETTINGS, rule="trimmed_mean", tolerate=1))
    a, b = two_on_block0(h)
    for tok, w in ((h.alice, a), (h.bob, b)):
        assert h.push(tok, w, 0, delta_body(0)).status_code == 200
    (row,) = h.client.get("/v1/status", headers=auth(h.alice)).json()["participation"]["0"]
    assert "needs more than 2 votes; 2 came" in row["held"]
    h.state.close()


def test_restart_after_the_deadline_closes_the_round_at_once(harness):
    h = harness
    a, _ = two_on_block0(h)
    assert h.push(h.alice, a, 0, delta_body(0)).status_code == 200
    h.clock.advance(SETTINGS.deadline_s + 5)
    h2 = h.reopen()
    assert h2.service.blocks[0].rounds.round == 1
    assert h2.state.ledger.updates(fate="accepted")[0].committed_version == 1
    h2.state.close()


# ------------------------------------------------------------------------------ accounting


def test_status_and_metrics_account_for_every_byte(harness):
    h = harness
    a, b = two_on_block0(h)
    body = delta_body(0)
    h.push(h.alice, a, 0, body)
    h.push(h.bob, b, 0, delta_body(0, scale=float("nan")))
    h.clock.advance(SETTINGS.deadline_s / 4)  # the minimum round length
    h.service.tick()  # b, refused, can no longer pass: a's update closes the round
    s = h.client.get("/v1/status", headers=auth(h.alice)).json()
    pull_size = len(h.service._cache[0][1])
    by_ep = s["bytes"]["by_endpoint"]
    assert by_ep["pull"]["requests"] == 2 and by_ep["pull"]["bytes_out"] == 2 * pull_size
    assert by_ep["push"]["bytes_in"] == 2 * len(body)
    registered = len(b'{"block":0}')  # the registration JSON
    assert s["bytes"]["by_worker"][str(a)]["bytes_in"] == len(body) + registered
    assert s["blocks"][0]["round"] == 1 and s["versions"] == [1, 0] and s["rounds"] == [1, 0]
    assert s["updates"] == {"accepted": 1, "refused": 1, "refused_by_reason": {"non_finite": 1}}
    (p,) = s["participation"]["0"]
    assert p["participation"] == 0.5 and p["reported"] == 2 and p["cause"] == "all_reported"
    assert s["workers"]["live"] == 2 and s["workers"]["per_block"] == [2, 0]
    text = h.client.get("/metrics").text
    assert 'blocktrain_block_version{block="0"} 1' in text
    assert 'blocktrain_updates_total{block="0",fate="refused",reason="non_finite"} 1' in text
    assert "# TYPE blocktrain_bytes_total counter" in text
    for line in text.splitlines():
        assert (
            line.startswith("#")
            or line.split(" ")[-1]
            .replace(".", "")
            .replace("e", "")
            .replace("-", "")
            .replace("+", "")
            .isdigit()
        ), line


def test_leaving_releases_the_round(harness):
    h = harness
    a, b = two_on_block0(h)
    assert h.push(h.alice, a, 0, delta_body(0)).status_code == 200
    r = h.client.delete(f"/v1/workers/{b}", headers=auth(h.bob, b))
    assert r.status_code == 200 and r.json()["left"] is True
    assert h.service.blocks[0].rounds.round == 1, "the round no longer waits for bob"
    assert h.pull(h.bob, b, 0).json()["reason"] == "unknown_worker"


def test_median_rule_and_outer_momentum(tmp_path):
    h = make_harness(
        tmp_path / "s",
        AggregatorSettings(
            deadline_s=30,
            local_steps=2,
            max_delta_norm=50,
            max_tokens=10_000,
            min_round_s=0.0,
            replay_rounds=0,
            rule="median",
            outer_momentum=0.5,
            outer_lr=1.0,
        ),
    )
    carol = add_token(h.state, "carol")
    workers = [
        (h.alice, h.register(h.alice, block=0)["worker_id"]),
        (h.bob, h.register(h.bob, block=0)["worker_id"]),
        (carol, h.register(carol, block=0)["worker_id"]),
    ]
    for tok, w in workers:
        h.pull(tok, w, 0)
    before = h.weights(0)
    for (tok, w), scale in zip(workers, (0.01, 0.02, 5.0), strict=True):
        assert h.push(tok, w, 0, delta_body(0, scale=scale)).status_code == 200
    med = torch.tensor(0.02, dtype=torch.float16).float()
    for name, t in before.items():  # nesterov, first step: theta + lr * (1 + mu) * delta
        assert torch.allclose(h.weights(0)[name], t + 1.5 * med, atol=1e-6), name
    assert h.state.versions(0, "m") == [1]
    h.state.close()
