"""The service observes each commit's drift on a thread of its own (service/drift_jobs.py):
outside its lock, and before the block's next update is judged."""

from __future__ import annotations

import dataclasses
import threading

import torch

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


def test_the_observation_runs_outside_the_lock_and_the_blocks_next_push_waits_for_it(tmp_path):
    h, tokens, workers = _harness(tmp_path)
    tracker = h.service.engine.drift
    observe, started, go = tracker.observe, threading.Event(), threading.Event()

    def held_observe(*args, **kwargs):
        started.set()
        assert go.wait(10)
        return observe(*args, **kwargs)

    tracker.observe = held_observe
    tensors = {k: 0.01 * torch.randn(t.shape) for k, t in h.weights(0).items()}
    assert (
        _round(h, tokens, workers, 0, lambda w: {k: v * (w + 1) for k, v in tensors.items()}) == {}
    )
    assert started.wait(10), "the commit queued its observation"
    assert h.service.lock.acquire(timeout=5), "the observation does not hold the service's lock"
    h.service.lock.release()
    assert h.client.get("/v1/status", headers=auth(h.alice)).status_code == 200
    version = int(h.pull(tokens[0], workers[0], 0).headers["x-version"])
    assert version == 1, "the commit published its version before its drift was observed"

    answers = []
    body = delta_body(0, tensors=tensors, round=1, base_version=version, dtype="fp32")
    pusher = threading.Thread(target=lambda: answers.append(h.push(tokens[0], workers[0], 0, body)))
    pusher.start()
    pusher.join(0.5)
    assert pusher.is_alive() and not answers, "the block's push waits for the observation"
    go.set()
    pusher.join(10)
    assert answers[0].status_code == 200, answers[0].text
    h.state.close()
