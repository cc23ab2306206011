"""The service observes each commit's drift on a thread of its own (service/drift_jobs.py):
outside its lock, and before the block's next round closes."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from blocktrain.protocol.core.drift import Drifted
from tests.protocol.conftest import SETTINGS, add_token, auth, delta_body, make_harness

DRIFT = dataclasses.replace(
    SETTINGS, wire_dtype="fp32", max_delta_norm=1e6, effect_probe="off", drift_min_rounds=3
)


def _round(h, tokens, workers, rnd, tensors_of):
    """Every worker pulls round `rnd` of block 0 and pushes; the reasons of the refused."""
    refused = {}
    versions = [
        int(h.pull(t, w, 0).headers["x-version"]) for t, w in zip(tokens, workers, strict=True)
    ]
    for t, w, version in zip(tokens, workers, versions, strict=True):
        body = delta_body(0, tensors=tensors_of(w), round=rnd, base_version=version, dtype="fp32")
        r = h.push(t, w, 0, body)
        if r.status_code != 200:
            refused[w] = r.json()["reason"]
    return refused


def _harness(tmp_path):
    h = make_harness(tmp_path / "s", DRIFT)
    tokens = [h.alice, h.bob, add_token(h.state, "carol"), add_token(h.state, "dave")]
    workers = [h.register(t, block=0)["worker_id"] for t in tokens]
    return h, tokens, workers


def test_a_leaning_token_is_refused_drift_through_the_service(tmp_path):
    h, tokens, workers = _harness(tmp_path)
    base = h.weights(0)
    gen = torch.Generator().manual_seed(3)

    def tensors_of(w):
        v = {k: 0.1 * torch.randn(t.shape, generator=gen) for k, t in base.items()}
        if w == workers[0]:
            first = sorted(v)[0]
            v[first].view(-1)[0] += 1.0  # the same lean every round
        return v

    for rnd in range(30):
        refused = _round(h, tokens, workers, rnd, tensors_of)
        h.service.tick()
        if refused:
            break
    assert refused == {workers[0]: "drift"}, (rnd, refused)
    h.state.close()


def test_the_observation_runs_outside_the_lock_and_its_flags_drop_the_open_rounds_updates(
    tmp_path,
):
    """Pushes go on while a commit is observed; the block's next round waits for the flags,
    and a flagged identity's update accepted meanwhile leaves it, refused `drift`."""
    h, tokens, workers = _harness(tmp_path)
    engine = h.service.engine
    leaning = engine.registry.identity(workers[0])
    started, go = threading.Event(), threading.Event()

    def held_observe(block, round, *args, **kwargs):
        started.set()
        assert go.wait(10)
        flag = engine.drift.refused[(block, leaning)] = Drifted(leaning, block, 99.0, 5, round + 3)
        return [flag]

    engine.drift.observe = held_observe
    tensors = {k: 0.01 * torch.randn(t.shape) for k, t in h.weights(0).items()}
    scaled = lambda w: {k: v * (w + 1) for k, v in tensors.items()}  # noqa: E731
    assert _round(h, tokens, workers, 0, scaled) == {}
    assert started.wait(10), "the commit queued its observation"
    assert h.service.lock.acquire(timeout=5), "the observation does not hold the service's lock"
    h.service.lock.release()
    assert h.client.get("/v1/status", headers=auth(h.alice)).status_code == 200

    assert _round(h, tokens, workers, 1, scaled) == {}, "answered at once, on the flags so far"
    h.service.tick()
    assert h.service.blocks[0].rounds.round == 1, "every replica passed, yet it waits for flags"
    go.set()
    h.service.drift_jobs.wait(0)
    assert h.service.blocks[0].rounds.round == 2, "the flags in, the round closed"
    rows = h.state.ledger.updates(block=0, round=1)
    fates = {r.worker_id: (r.fate, r.reason) for r in rows}
    assert fates.pop(workers[0]) == ("refused", "drift")
    assert set(fates.values()) == {("accepted", None)}
    assert {r.committed_version for r in rows if r.fate == "accepted"} == {2}
    assert not [r for r in rows if r.worker_id == workers[0] and r.pending], "its body is gone"
    r = _round(h, tokens, workers, 2, scaled)
    assert r == {workers[0]: "drift"}, "and it is refused from the next round on"
    h.state.close()


@pytest.mark.parametrize("part", ["observe", "penalise"])
def test_a_failed_observation_leaves_the_next_round_free_to_close(
    tmp_path, caplog, monkeypatch, part
):
    """Whether the selection or the flags' application fails, the round after closes, and the
    thread lives on to observe the next commits."""
    h, tokens, workers = _harness(tmp_path)
    calls = []

    def failing(*args, **kwargs):
        calls.append(part)
        raise RuntimeError("it broke")

    owner = h.service.engine.drift if part == "observe" else h.service.engine
    monkeypatch.setattr(owner, part, failing)
    tensors = {k: 0.01 * torch.randn(t.shape) for k, t in h.weights(0).items()}
    scaled = lambda w: {k: v * (w + 1) for k, v in tensors.items()}  # noqa: E731
    for rnd in range(3):
        assert _round(h, tokens, workers, rnd, scaled) == {}
        assert h.service.drift_jobs.last[0].wait(10), "the commit was observed"
        assert h.service.blocks[0].rounds.round == rnd + 1
    assert len(calls) == 3, "a failure each commit, and the thread still there for the next"
    assert "drift observation failed" in caplog.text
    h.state.close()
