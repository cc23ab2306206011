"""Compressed pulls (`protocol.core.pulls`) without exact pulls (`exact_pulls = off`): a version
sent as an int8 or top-k delta from the view a worker holds, error feedback in the view, and the
fallbacks to a whole pull (a base the aggregator does not hold, a body that does not lead to the
view it names). Exact pulls: test_exact_pulls.py."""

from __future__ import annotations

import random

import pytest
import torch

from blocktrain import tensorwire
from blocktrain.errors import ProtocolError, Refused
from blocktrain.protocol.core.delta_wire import DeltaWire, pull_codec
from blocktrain.protocol.core.pulls import View, Views, apply, read_delta, view_id
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.http.status import snapshot
from blocktrain.protocol.worker.client import AggregatorClient
from tests.protocol.conftest import SETTINGS, Harness, block_tensors, make_harness

INT8 = DeltaWire.parse("int8")


def drift(weights: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Version `step` of a block whose weights move a little every round."""
    gen = torch.Generator().manual_seed(step)
    return {k: v + 0.01 * step * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


def gap(view: View, weights: dict[str, torch.Tensor]) -> float:
    return max(float((view.tensors[k].float() - w).abs().max()) for k, w in weights.items())


def test_a_view_is_named_by_its_contents():
    t = block_tensors(1)
    assert view_id(t) == view_id({k: v.clone() for k, v in reversed(t.items())})
    changed = {**t, "embed": t["embed"].clone()}
    changed["embed"][0, 0] += 1e-3
    assert view_id(changed) != view_id(t)
    assert view_id({k: v.half() for k, v in t.items()}) != view_id(t)  # the dtype counts


def test_int8_chain_keeps_within_one_delta_of_the_weights():
    views = Views("fp16")
    w0 = wv = block_tensors(1)
    held = views.whole(0, 0, w0)
    gen = torch.Generator().manual_seed(0)
    for v in range(1, 30):  # the weights take a step of about 0.01 per round
        wv = {k: t + 0.01 * torch.randn(t.shape, generator=gen) for k, t in wv.items()}
        sent = views.delta(0, v, wv, held.id, INT8)
        held = read_delta(sent.body, held, v, INT8)
        assert held.id == sent.view.id
        # int8 error of one step (max row |step| / 254, about 1e-4) plus fp16 rounding of
        # values below 4 (1e-3): a bound that does not grow with v, where the steps add up to 0.3
        assert gap(held, wv) < 1.5e-3, v


def test_topk_error_feedback_reaches_the_weights_when_they_stop_moving():
    views = Views("fp16")
    codec = DeltaWire.parse("topk:0.1")
    w0 = block_tensors(2)
    held = views.whole(0, 0, w0)
    target = drift(w0, 5)
    first = None
    for v in range(1, 15):  # the weights moved once; each delta sends the 10 % largest left
        held = read_delta(views.delta(0, v, target, held.id, codec).body, held, v, codec)
        first = first if first is not None else gap(held, target)
    assert gap(held, target) < 2e-3 < first  # fp16 rounding is all that is left


def test_a_base_the_aggregator_does_not_hold_is_refused():
    views = Views("fp16")
    with pytest.raises(Refused) as err:
        views.delta(0, 1, block_tensors(1), "0" * 32, INT8)
    assert (err.value.reason, err.value.status) == ("unknown_base", 404)


def test_read_delta_refuses_a_body_that_is_not_what_it_says():
    views = Views("fp16")
    w0 = block_tensors(1)
    held = views.whole(0, 0, w0)
    sent = views.delta(0, 1, drift(w0, 1), held.id, INT8)
    decoded = tensorwire.decode(sent.body)
    parts = decoded.to_torch()

    def body(meta: dict[str, str], tensors=parts) -> bytes:
        return tensorwire.encode(tensors, {**decoded.metadata, **meta})

    with pytest.raises(ProtocolError, match="not block 0 version 2"):
        read_delta(sent.body, held, 2, INT8)  # another version
    with pytest.raises(ProtocolError, match="led to view"):
        read_delta(body({"view": "f" * 32}), held, 1, INT8)  # a result it does not lead to
    scales = {**parts, "embed#scale": torch.full_like(parts["embed#scale"], float("nan"))}
    with pytest.raises(ProtocolError, match="bad_scales"):
        read_delta(body({}, scales), held, 1, INT8)
    with pytest.raises(ProtocolError, match="missing_tensors"):
        read_delta(body({}, {k: v for k, v in parts.items() if k != "embed"}), held, 1, INT8)
    with pytest.raises(ProtocolError, match="wrong_wire"):
        read_delta(sent.body, held, 1, DeltaWire.parse("topk:0.1"))
    other = View(
        0, 0, apply(held.tensors, {k: torch.ones_like(v.float()) for k, v in held.tensors.items()})
    )
    with pytest.raises(ProtocolError, match="from view"):
        read_delta(sent.body, other, 1, INT8)  # from another base


def test_pull_wire_setting():
    assert AggregatorSettings().pulls == "full"
    assert AggregatorSettings(delta_wire="int8").pulls == "int8"
    assert AggregatorSettings(delta_wire="topk:0.1").pulls == "topk:0.1"
    assert AggregatorSettings(delta_wire="topk:0.1", pull_wire="int8").pulls == "int8"
    assert AggregatorSettings(pull_wire="full", delta_wire="int8").pulls == "full"
    # sparse pushes pull a version's delta (the mean of every replica's votes) denser
    assert AggregatorSettings(delta_wire="sparse:0.03:2").pulls == "sparse:0.06:4"
    assert AggregatorSettings(delta_wire="sparse:0.07:8:chunk=32").pulls == "sparse:0.14:8:chunk=32"
    assert AggregatorSettings(delta_wire="sparse:0.4:2").pulls == "sparse:0.5:4"
    assert AggregatorSettings(delta_wire="sparse:0.03:2", pull_wire="sparse:0.03:2").pulls == (
        "sparse:0.03:2"
    )
    for bad in ("fp16", "int4", "topk:2"):
        with pytest.raises(Exception, match="pull_wire"):
            AggregatorSettings(pull_wire=bad)
    assert pull_codec("full") is None and pull_codec("topk:0.03") == DeltaWire("topk", 0.03)
    assert str(DeltaWire.parse("topk:0.03")) == "topk:0.03"


def test_the_codecs_line_names_every_kind_of_byte():
    relay = {"model": {"route": "relay"}, "train": {"relay_bits": 4, "relay_every": 2}}
    sparse = AggregatorSettings(delta_wire="sparse:0.03:2")
    assert sparse.codecs(relay) == (
        "pushes sparse:0.03:2, pulls sparse:0.06:4 (exact commits), relayed streams 4-bit, "
        "one step in 2"
    )
    off = AggregatorSettings(delta_wire="int8", exact_pulls="off")
    assert off.codecs({"model": {"route": "state"}}) == (
        "pushes int8, pulls int8 (from the view held)"
    )
    dense = AggregatorSettings().codecs({"model": {"route": "features"}})
    assert dense.startswith("pushes fp16 (dense), pulls whole versions in fp16")
    assert "blocks before it" in dense
    # a run config without the keys (a saved older one) reads the defaults: relay, 8 bits
    assert AggregatorSettings().codecs({}).endswith("relayed streams 8-bit")
    # DiLoCo-style reference replicas have no blocks to relay between
    assert AggregatorSettings().codecs({"unit": "reference"}).endswith("in fp16")


def record(h: Harness) -> tuple[list[tuple[str, int]], list[bytes]]:
    """(path, status) of every answer the harness's client gets, and the delta bodies."""
    paths: list[tuple[str, int]] = []
    deltas: list[bytes] = []

    def seen(r) -> None:
        paths.append((r.request.url.path, r.status_code))
        if r.request.url.path.endswith("/delta"):
            deltas.append(r.read())

    h.client.event_hooks["response"].append(seen)
    return paths, deltas


def test_a_worker_pulls_the_next_version_as_a_delta_over_http(tmp_path):
    h = make_harness(
        tmp_path / "s", SETTINGS.replace(delta_wire="int8", exact_pulls="off")
    )  # pulls follow
    paths, delta_bodies = record(h)
    c = AggregatorClient("http://agg", h.alice, client=h.client, rng=random.Random(0))
    reg = c.register(block=0)
    assert reg.pull_wire == "int8"
    first = c.pull(0)
    for version in range(3):  # one replica: each push closes a round, a new version
        delta = {k: torch.full_like(v, 0.01 * (version + 1)) for k, v in first.tensors.items()}
        assert c.push(
            0, delta, base_version=version, round=version, tokens=64, dtype="int8"
        ).accepted
        pulled = c.pull(0)
        assert pulled.version == version + 1
        assert paths[-1] == (f"/v1/blocks/0/versions/{version + 1}/delta", 200)
        assert pulled.nbytes == len(delta_bodies[-1])
        for name, t in h.service.blocks[0].weights.items():
            torch.testing.assert_close(pulled.tensors[name], t, atol=3e-3, rtol=1e-3)
        first = pulled
    again = c.pull(0)  # the version held: no request for its weights at all
    assert again.version == 3 and paths[-1][0] == "/v1/blocks/0"
    block = snapshot(h.service)["blocks"][0]
    assert block["pull_bytes"] == block["delta_bytes"] < block["wire_bytes"]  # int8 both ways


def test_a_worker_falls_back_to_a_whole_pull_when_the_base_is_unknown(tmp_path):
    h = make_harness(tmp_path / "s", SETTINGS.replace(pull_wire="int8", exact_pulls="off"))
    paths, _ = record(h)
    c = AggregatorClient("http://agg", h.alice, client=h.client, rng=random.Random(0))
    c.register(block=0)
    first = c.pull(0)
    delta = {k: torch.full_like(v, 0.01) for k, v in first.tensors.items()}
    assert c.push(0, delta, base_version=0, round=0, tokens=64).accepted
    h.client.app.state.versions.views = Views("fp16")  # type: ignore[attr-defined]
    pulled = c.pull(0)  # as after a restart: the aggregator forgot every view
    assert ("/v1/blocks/0/versions/1/delta", 404) in paths
    assert paths[-1] == ("/v1/blocks/0/versions/1", 200) and pulled.version == 1


def test_delta_route_checks_the_wire_and_the_token(tmp_path):
    h = make_harness(tmp_path / "s", SETTINGS.replace(pull_wire="int8", exact_pulls="off"))
    url = "/v1/blocks/0/versions/0/delta"
    headers = {"Authorization": f"Bearer {h.alice}"}
    r = h.client.get(url, params={"base": "0" * 32, "wire": "topk:0.1"}, headers=headers)
    assert (r.status_code, r.json()["reason"]) == (400, "wrong_wire")
    r = h.client.get(url, params={"base": "0" * 32, "wire": "int8"}, headers=headers)
    assert (r.status_code, r.json()["reason"]) == (404, "unknown_base")
    r = h.client.get(url, params={"base": "0" * 32, "wire": "int8"})
    assert r.status_code == 401
    r = h.client.get(url, params={"base": "x" * 65, "wire": "int8"}, headers=headers)
    assert r.status_code == 422


def test_a_worker_told_wrong_wire_pulls_whole_versions_until_it_registers_again(tmp_path):
    h = make_harness(tmp_path / "s", SETTINGS.replace(pull_wire="int8", exact_pulls="off"))
    paths, _ = record(h)
    c = AggregatorClient("http://agg", h.alice, client=h.client, rng=random.Random(0))
    c.register(block=0)
    first = c.pull(0)
    c.pull_wire = "topk:0.1"  # as if the aggregator restarted with another --pull-wire
    delta = {k: torch.full_like(v, 0.01) for k, v in first.tensors.items()}
    assert c.push(0, delta, base_version=0, round=0, tokens=64).accepted
    assert c.pull(0).version == 1
    assert ("/v1/blocks/0/versions/1/delta", 400) in paths
    assert paths[-1] == ("/v1/blocks/0/versions/1", 200) and c.pull_wire == "full"


@pytest.mark.parametrize("exact", ["off", "on"])
def test_a_worker_reads_an_upstream_block_as_deltas_from_its_view(tmp_path, exact):
    """route = features: a worker of block 1 reads block 0's latest version with `latest`. With
    a pull codec the first read is whole and every later version a delta from the view it holds
    of block 0 (under exact pulls: the version's commit), apart from the view of its own
    block."""
    h = make_harness(tmp_path / "s", SETTINGS.replace(delta_wire="int8", exact_pulls=exact))
    paths, delta_bodies = record(h)
    pusher = AggregatorClient("http://agg", h.bob, client=h.client, rng=random.Random(0))
    reader = AggregatorClient("http://agg", h.alice, client=h.client, rng=random.Random(1))
    pusher.register(block=0)
    reader.register(block=1)
    own = reader.pull(1)
    first = reader.latest(0)
    assert paths[-1] == ("/v1/blocks/0/versions/0", 200)  # the first read: whole
    for version in range(2):  # one replica: each push closes a round, a new version
        base = pusher.pull(0)
        delta = {k: torch.full_like(v, 0.01 * (version + 1)) for k, v in base.tensors.items()}
        assert pusher.push(
            0, delta, base_version=version, round=version, tokens=64, dtype="int8"
        ).accepted
        read = reader.latest(0)
        assert paths[-1] == (f"/v1/blocks/0/versions/{version + 1}/delta", 200)
        for name, t in h.service.blocks[0].weights.items():
            torch.testing.assert_close(read[name], t, atol=3e-3, rtol=1e-3)
    assert delta_bodies and any(not torch.equal(first[k], read[k]) for k in first)
    assert reader.view is not None and reader.view.block == 1  # its own block's view kept
    assert reader.pull(1).version == own.version
