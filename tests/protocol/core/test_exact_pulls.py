"""Exact pulls (`protocol.core.pulls`, the setting `exact_pulls`): every version committed as
the pull codec carries it, the remainder carried to the next commit, views that hold the
weights up to the rounding of their first whole pull, the walk of a worker that is behind, and
the remainder across a restart."""

from __future__ import annotations

import random

import pytest
import torch

from blocktrain.errors import ProtocolError, Refused
from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.protocol.core.pulls import (
    KEEP_COMMITS,
    Commits,
    View,
    Views,
    commit_step,
    read_commit,
    read_delta,
    whole_view,
)
from blocktrain.protocol.worker.client import AggregatorClient
from tests.protocol.conftest import SETTINGS, make_harness

SPARSE = DeltaWire.parse("sparse:0.06:4")


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: a[k].float() - b[k].float() for k in a}


def weights() -> dict[str, torch.Tensor]:
    """A block of a 128 x 128 matrix (4 chunks of 64 x 64) and a vector."""
    gen = torch.Generator().manual_seed(1)
    return {"w": torch.randn(128, 128, generator=gen), "b": torch.randn(128, generator=gen)}


def steps(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n dense steps of about 1e-3 a coordinate: what no 6 % codec carries in one commit."""
    gen = torch.Generator().manual_seed(seed)
    return [{k: 1e-3 * torch.randn(v.shape, generator=gen) for k, v in weights().items()}] * n


def test_commit_step_carries_what_the_codec_left_out_to_the_next_commit():
    old = weights()
    remainder = None
    total = {k: torch.zeros_like(v) for k, v in old.items()}
    w = old
    for step in steps(12):
        total = {k: total[k] + step[k] for k in total}
        made = commit_step(w, {k: w[k] + step[k] for k in w}, remainder, SPARSE)
        # nothing is lost: the weights plus the remainder are the old weights plus every step
        for k in w:
            torch.testing.assert_close(made.weights[k] + made.remainder[k], old[k] + total[k])
        # and the committed step is sparse: 6 % of each chunk (and of the vector) moved
        moved = sum(int((made.weights[k] != w[k]).sum()) for k in w)
        assert 0 < moved <= 0.06 * sum(v.numel() for v in w.values()) + 2
        w, remainder = made.weights, made.remainder


def test_a_view_that_pulls_every_commit_holds_the_weights_up_to_its_first_rounding():
    """Under exact pulls the gap between a worker's view and the weights stays the fp16
    rounding of its whole pull; from the view (the lossy design) it is a codec's error."""
    old = weights()
    commits, lossy = Commits(SPARSE), Views("fp16")
    held = whole_view(0, 0, old, "fp16", exact=True)
    held_lossy = lossy.whole(0, 0, old)
    first = gap(held.tensors, old)
    w, remainder = old, None
    for v, step in enumerate(steps(10), start=1):
        made = commit_step(w, {k: w[k] + step[k] for k in w}, remainder, SPARSE)
        w, remainder = made.weights, made.remainder
        commits.add(0, v, made.parts)
        held = read_commit(commits.get(0, v).body, held, v, SPARSE)
        sent = lossy.delta(0, v, w, held_lossy.id, SPARSE)
        held_lossy = read_delta(sent.body, held_lossy, v, SPARSE)
    assert all(t.dtype == torch.float32 for t in held.tensors.values())
    now = gap(held.tensors, w)
    # the first rounding (about 1e-4 here), unchanged but for fp32 noise
    assert max(float((now[k] - first[k]).abs().max()) for k in w) < 1e-6
    assert max(float(t.abs().max()) for t in first.values()) > 1e-5
    lagged = gap(held_lossy.tensors, w)
    assert max(float(t.abs().max()) for t in lagged.values()) > 1e-3  # the lossy view lags


def test_a_commit_applies_to_the_version_before_only():
    commits = Commits(SPARSE)
    w = weights()
    held = whole_view(0, 0, w, "fp16", exact=True)
    made = commit_step(w, {k: v + 0.01 for k, v in w.items()}, None, SPARSE)
    commits.add(0, 1, made.parts)
    commits.add(0, 2, made.parts)
    with pytest.raises(ProtocolError, match="applies to version 1, not 0"):
        read_commit(commits.get(0, 2).body, held, 2, SPARSE)  # two versions on: walk
    with pytest.raises(ProtocolError, match="version 1 from version 0, not block 0 version 2"):
        read_commit(commits.get(0, 1).body, View(0, 1, held.tensors), 2, SPARSE)
    assert read_commit(commits.get(0, 1).body, held, 1, SPARSE).version == 1
    assert commits.holds(0, 1, 2) and not commits.holds(0, 1, 3)
    with pytest.raises(Refused) as err:
        commits.get(0, 3)
    assert (err.value.reason, err.value.status) == ("version_gone", 410)
    for v in range(3, 3 + KEEP_COMMITS):
        commits.add(0, v, made.parts)
    assert not commits.holds(0, 1, 1)  # the oldest are let go


def behind_by_two(tmp_path, exact: str):
    """A worker that pulled version 0, while another's pushes made versions 1 and 2."""
    h = make_harness(
        tmp_path / "s", SETTINGS.replace(delta_wire="sparse:0.03:2", exact_pulls=exact)
    )
    paths: list[tuple[str, int]] = []
    queries: list[str] = []

    def seen(r) -> None:
        paths.append((r.request.url.path, r.status_code))
        queries.append(r.request.url.query.decode())

    h.client.event_hooks["response"].append(seen)
    late = AggregatorClient("http://agg", h.alice, client=h.client, rng=random.Random(0))
    busy = AggregatorClient("http://agg", h.bob, client=h.client, rng=random.Random(1))
    late.register(block=0)
    busy.register(block=0)
    late.pull(0)
    for version in range(2):
        base = busy.pull(0)
        delta = {k: torch.full_like(v, 0.01 * (version + 1)) for k, v in base.tensors.items()}
        wire = "sparse:0.03:2"
        assert busy.push(
            0, delta, base_version=version, round=version, tokens=64, dtype=wire
        ).accepted
        h.clock.advance(SETTINGS.deadline_s + 1)  # the late worker never pushes: the round ends
        h.service.tick()
    return h, late, paths, queries


def test_a_worker_behind_walks_the_commits_over_http(tmp_path):
    h, late, paths, queries = behind_by_two(tmp_path, "on")
    assert late.exact_pulls
    before = len(paths)
    pulled = late.pull(0)
    assert pulled.version == 2
    assert [p for p in paths[before:] if p[0].endswith("/delta")] == [
        ("/v1/blocks/0/versions/1/delta", 200),
        ("/v1/blocks/0/versions/2/delta", 200),
    ]
    # one URL for every worker (no base): the same body, as cacheable as the version
    assert all("base=" not in q for q in queries[before:])
    assert late.view is not None and late.view.version == 2
    weights = h.service.blocks[0].weights
    for name, t in weights.items():  # within the fp16 rounding of the first whole pull
        torch.testing.assert_close(pulled.tensors[name], t, atol=2e-3, rtol=1e-3)
    h.state.close()


def test_without_exact_pulls_a_worker_behind_takes_one_delta(tmp_path):
    h, late, paths, _ = behind_by_two(tmp_path, "off")
    assert not late.exact_pulls
    before = len(paths)
    assert late.pull(0).version == 2
    assert [p for p in paths[before:] if p[0].endswith("/delta")] == [
        ("/v1/blocks/0/versions/2/delta", 200)
    ]
    h.state.close()


def test_the_remainder_is_written_with_each_version_and_read_back_on_restart(tmp_path):
    h, _, _, _ = behind_by_two(tmp_path, "on")
    remainder = h.service.blocks[0].remainder
    assert remainder is not None and any(float(t.abs().max()) > 0 for t in remainder.values())
    assert h.state.has_tensors(0, 2, "r")
    again = h.reopen()
    restored = again.service.blocks[0].remainder
    assert restored is not None
    for k, t in remainder.items():
        assert torch.equal(restored[k], t)
    again.state.close()


def test_after_a_restart_the_commits_are_gone_and_a_worker_pulls_whole(tmp_path):
    h, late, _, _ = behind_by_two(tmp_path, "on")
    again = h.reopen()
    late.http = again.client
    seen: list[tuple[str, int]] = []
    again.client.event_hooks["response"].append(
        lambda r: seen.append((r.request.url.path, r.status_code))
    )
    assert late.pull(0).version == 2
    assert ("/v1/blocks/0/versions/1/delta", 410) in seen
    assert seen[-1] == ("/v1/blocks/0/versions/2", 200)
    again.state.close()
