"""Compressed deltas (`protocol.core.codecs`): each codec's round trip, error feedback, and the
aggregator's refusal of compressed bodies that could open a hole."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from blocktrain import tensorwire
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.bodies import decode as decode_body
from blocktrain.protocol.core.bodies import update_body
from blocktrain.protocol.core.codecs import DeltaEncoder, compress, decode
from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.validation import BlockSpec, Candidate, Limits, validate
from blocktrain.protocol.core.verdict import REASONS
from blocktrain.protocol.worker.loop import WorkerLoop
from tests.protocol.conftest import auth, block_tensors, make_harness
from tests.protocol.worker.test_worker import FakeTrainer, client_for, distinct_delta

SHAPES = {"w": (6, 5), "b": (6,), "s": ()}
LIMITS = Limits(max_delta_norm=50.0, max_tokens=1000)


def delta(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def judge(body: bytes, wire: str):
    c = Candidate(1, decode_body(body), BlockSpec(SHAPES, "fp16", wire), LIMITS)
    return validate(c), c


def body_of(parts: dict[str, torch.Tensor], wire_kind: str | None) -> bytes:
    meta = {"block": "1", "base_version": "0", "round": "0", "tokens": "10"}
    if wire_kind is not None:
        meta["delta_wire"] = wire_kind
    return tensorwire.encode(parts, meta)


@pytest.mark.parametrize("text", ["fp16", "bf16", "fp32", "int8", "topk:0.1", "topk:0.03"])
def test_wire_names_parse(text):
    wire = DeltaWire.parse(text)
    assert wire.kind == text.split(":")[0]
    assert AggregatorSettings(delta_wire=text).push_wire == text


@pytest.mark.parametrize("text", ["topk:0", "topk:2", "topk:1", "int9", "topk", "topk:x", "int8:4"])
def test_bad_wire_names_are_refused_with_what_is_accepted(text):
    with pytest.raises(ValueError, match=r"topk:RATIO"):
        DeltaWire.parse(text)
    with pytest.raises(ConfigError, match=r"delta_wire = .* must be fp16, bf16, fp32, int8"):
        AggregatorSettings(delta_wire=text)


def test_the_delta_wire_defaults_to_the_weights_dtype():
    assert AggregatorSettings().push_wire == "fp16"
    assert AggregatorSettings(wire_dtype="fp32").push_wire == "fp32"
    assert AggregatorSettings(wire_dtype="fp32", delta_wire="int8").push_wire == "int8"


def test_int8_round_trip_is_within_half_a_step_of_each_rows_scale():
    d = delta(1)
    d["w"][2] = 0.0  # an all-zero row has scale 0 and decodes to zeros
    out = compress(d, DeltaWire.parse("int8"))
    assert out.parts["w"].dtype == torch.int8 and out.parts["w#scale"].shape == (6,)
    assert out.parts["b#scale"].shape == (1,) and out.parts["s#scale"].shape == (1,)
    verdict, c = judge(update_body(1, d, base_version=0, round=0, tokens=10, dtype="int8"), "int8")
    assert verdict.accepted, verdict
    for name, x in d.items():
        rows = x.reshape(x.shape[0] if x.dim() >= 2 else 1, -1)
        step = rows.abs().amax(dim=1, keepdim=True) / 127
        err = (c.tensors[name] - x).abs().reshape(rows.shape)
        assert bool((err <= step / 2 + 1e-7).all()), name
        assert torch.allclose(c.tensors[name], out.sent[name])
    assert bool((c.tensors["w"][2] == 0).all())


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    d = delta(2)
    wire = DeltaWire.parse("topk:0.2")
    verdict, c = judge(
        update_body(1, d, base_version=0, round=0, tokens=10, dtype="topk:0.2"), "topk:0.2"
    )
    assert verdict.accepted, verdict
    for name, x in d.items():
        flat = x.reshape(-1)
        k = max(1, math.ceil(0.2 * flat.numel()))
        assert wire.k(flat.numel()) == k
        want = set(flat.abs().argsort(descending=True)[:k].tolist())
        got = c.tensors[name].reshape(-1)
        assert set(got.nonzero().reshape(-1).tolist()) == want, name
        kept = torch.tensor(sorted(want))
        assert torch.allclose(got[kept], flat[kept].half().float())


@pytest.mark.parametrize("wire", ["int8", "topk:0.1", "topk:0.03"])
def test_error_feedback_sends_everything_in_the_end(wire):
    """sum of what was sent + the residual == sum of the true deltas, every round."""
    encoder = DeltaEncoder(wire)
    true = {k: torch.zeros(s) for k, s in SHAPES.items()}
    sent = {k: torch.zeros(s) for k, s in SHAPES.items()}
    for r in range(6):
        d = delta(10 + r)
        out = encoder.compress(d)
        assert out.wire.kind == wire.split(":")[0]
        for k in SHAPES:
            true[k] += d[k]
            sent[k] += out.sent[k]
        assert encoder.residual is not None
        for k in SHAPES:
            assert torch.allclose(sent[k] + encoder.residual[k], true[k], atol=1e-5), (r, k)
    encoder.reset()
    assert encoder.residual is None


def test_dense_wires_keep_no_residual():
    encoder = DeltaEncoder("fp16")
    encoder.compress(delta())
    assert encoder.residual is None


def q_parts(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    parts = dict(compress(delta(3), DeltaWire.parse("int8")).parts)
    parts.update(changes)
    return parts


def k_parts(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    parts = dict(compress(delta(3), DeltaWire.parse("topk:0.2")).parts)
    parts.update({k.replace("__", "#"): v for k, v in changes.items()})
    return parts


I32 = torch.int32


@pytest.mark.parametrize(
    ("parts", "kind", "wire", "reason"),
    [
        # codec other than the announced one
        (compress(delta(), DeltaWire.parse("fp16")).parts, None, "int8", "wrong_wire"),
        (q_parts(), "int8", "topk:0.1", "wrong_wire"),
        (q_parts(), "int8", "fp16", "wrong_wire"),
        # int8: scales, parts, dtypes
        ({**q_parts(), "w#scale": torch.full((6,), math.nan)}, "int8", "int8", "bad_scales"),
        ({**q_parts(), "b#scale": torch.tensor([math.inf])}, "int8", "int8", "bad_scales"),
        ({**q_parts(), "b#scale": torch.tensor([-1.0])}, "int8", "int8", "bad_scales"),
        ({**q_parts(), "w#scale": torch.full((6,), 3e38)}, "int8", "int8", "non_finite"),
        ({**q_parts(), "w#scale": torch.full((6,), 1.0)}, "int8", "int8", "norm_too_large"),
        ({**q_parts(), "w#scale": torch.ones(5)}, "int8", "int8", "bad_shape"),
        ({**q_parts(), "w#scale": torch.ones(6).half()}, "int8", "int8", "bad_dtype"),
        ({**q_parts(), "w": torch.zeros(6, 5).half()}, "int8", "int8", "bad_dtype"),
        ({k: v for k, v in q_parts().items() if k != "w#scale"}, "int8", "int8", "missing_tensors"),
        ({**q_parts(), "w#extra": torch.ones(1)}, "int8", "int8", "extra_tensors"),
        # top-k: indices, k
        (
            k_parts(w__indices=torch.tensor([0, 1, 2, 3, 2, 5], dtype=I32)),
            "topk",
            "topk:0.2",
            "bad_indices",
        ),
        (
            k_parts(w__indices=torch.tensor([5, 4, 3, 2, 1, 0], dtype=I32)),
            "topk",
            "topk:0.2",
            "bad_indices",
        ),
        (
            k_parts(w__indices=torch.tensor([0, 1, 2, 3, 4, 30], dtype=I32)),
            "topk",
            "topk:0.2",
            "bad_indices",
        ),
        (
            k_parts(w__indices=torch.tensor([-1, 1, 2, 3, 4, 5], dtype=I32)),
            "topk",
            "topk:0.2",
            "bad_indices",
        ),
        (
            k_parts(w__values=torch.ones(31).half(), w__indices=torch.arange(31, dtype=I32)),
            "topk",
            "topk:0.2",
            "bad_k",
        ),
        (k_parts(w__values=torch.ones(5).half()), "topk", "topk:0.2", "bad_k"),
        (
            k_parts(w__values=torch.ones(6, 1).half(), w__indices=torch.zeros(6, 1, dtype=I32)),
            "topk",
            "topk:0.2",
            "bad_k",
        ),
        (k_parts(w__indices=torch.arange(6, dtype=torch.int64)), "topk", "topk:0.2", "bad_dtype"),
        (k_parts(w__values=torch.ones(6)), "topk", "topk:0.2", "bad_dtype"),
        (k_parts(w__values=torch.full((6,), math.nan).half()), "topk", "topk:0.2", "non_finite"),
        (k_parts(w__values=torch.full((6,), 60000.0).half()), "topk", "topk:0.2", "norm_too_large"),
    ],
)
def test_malformed_compressed_bodies_are_refused_with_a_reason(parts, kind, wire, reason):
    verdict, _ = judge(body_of(parts, kind), wire)
    assert not verdict.accepted and verdict.reason == reason, verdict
    assert verdict.detail
    assert 400 <= REASONS[reason][0] < 500


def test_a_topk_tensor_may_send_nothing_or_everything():
    parts = k_parts(w__values=torch.ones(30).half(), w__indices=torch.arange(30, dtype=I32))
    parts.update({"b#values": torch.ones(0).half(), "b#indices": torch.zeros(0, dtype=I32)})
    verdict, c = judge(body_of(parts, "topk"), "topk:0.2")
    assert verdict.accepted, verdict
    assert bool((c.tensors["w"] == 1).all()) and bool((c.tensors["b"] == 0).all())


def test_decode_matches_what_the_encoder_says_it_sent():
    for text in ("fp16", "bf16", "int8", "topk:0.3"):
        out = compress(delta(4), DeltaWire.parse(text))
        raw = decode_body(body_of(out.parts, None)).tensors
        dense = decode(raw, SHAPES, DeltaWire.parse(text))
        for k in SHAPES:
            assert torch.allclose(dense[k].float(), out.sent[k]), (text, k)


def test_workers_push_the_announced_wire_and_the_aggregator_counts_its_bytes(tmp_path):
    from tests.protocol.worker.test_worker import SETTINGS

    sizes: dict[str, int] = {}
    for wire in ("fp16", "int8", "topk:0.1", "sparse:0.1:4"):
        h = make_harness(tmp_path / wire.replace(":", "_"), SETTINGS.replace(delta_wire=wire))
        try:
            trainer = FakeTrainer()
            loop = WorkerLoop(client_for(h, h.alice), lambda reg, cfg, t=trainer: t, block=0)
            report = loop.run()
            assert report.stopped_by == "done" and report.accepted == 4, report
            traffic = h.service.traffic.summary()["by_endpoint"]
            assert traffic["push"]["bytes_in"] == report.bytes_up
            (status,) = [
                b
                for b in h.client.get("/v1/status", headers=auth(h.alice)).json()["blocks"]
                if b["block"] == 0
            ]
            assert status["delta_bytes"] == h.service.blocks[0].spec.delta_bytes
            sizes[wire] = report.bytes_up
            base = block_tensors(100)  # block 0's version 0
            moved = {k: h.service.engine.blocks[0].weights[k] - base[k] for k in base}
            if wire in ("topk:0.1", "sparse:0.1:4"):  # error feedback: unsent ones come later
                assert 0 < float(moved["layer.weight"].count_nonzero()) < 32
            else:
                sent = sum(distinct_delta(base, n)["layer.weight"] for n in range(1, 5))
                assert torch.allclose(moved["layer.weight"], sent, atol=1e-3)
        finally:
            h.state.close()
    assert len(set(sizes.values())) == 4, "each wire's pushes are counted at their own size"


def test_compressed_bodies_are_a_fraction_of_fp16():
    big = {"w": torch.randn(256, 512), "b": torch.randn(512)}
    size = {
        wire: len(update_body(0, big, base_version=0, round=0, tokens=1, dtype=wire))
        for wire in ("fp16", "int8", "topk:0.1", "topk:0.03")
    }
    assert size["int8"] <= 0.51 * size["fp16"]  # 1 byte a value, a 4-byte scale a row
    assert size["topk:0.1"] <= 0.31 * size["fp16"]  # 2 + 4 bytes a kept value
    assert size["topk:0.03"] <= 0.1 * size["fp16"]
    shapes = {k: tuple(v.shape) for k, v in big.items()}
    for wire, n in size.items():  # the status's delta_bytes: the data, without the header
        data = BlockSpec(shapes, "fp16", wire).delta_bytes
        assert data < n < data + 1024, wire


@pytest.mark.parametrize("wire", ["topk:0.5", "sparse:0.5:4:chunk=4"])
def test_a_restarted_aggregator_decodes_its_pending_compressed_bodies(tmp_path, wire):
    """The open round's accepted bodies are kept as they came (top-k or sparse parts); after a
    restart they join the accumulator as the dense deltas they describe (a sparse body by the
    layout its delta_wire names)."""
    from tests.protocol.conftest import SETTINGS

    h = make_harness(tmp_path / "s", SETTINGS.replace(delta_wire=wire))
    base = h.weights(0)
    gen = torch.Generator().manual_seed(7)
    d = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in base.items()}
    sent = DeltaEncoder(wire).compress(d)
    a, b = (h.register(t, block=0)["worker_id"] for t in (h.alice, h.bob))
    assert h.pull(h.alice, a, 0).status_code == 200 and h.pull(h.bob, b, 0).status_code == 200
    body = update_body(0, sent, base_version=0, round=0, tokens=100, worker_id=a)
    r = h.push(h.alice, a, 0, body)
    assert r.status_code == 200, r.text
    assert h.service.blocks[0].rounds.version == 0, "the round waits for bob"
    h2 = h.reopen()  # killed with alice's body pending: the deadline commits it
    try:
        h2.clock.advance(SETTINGS.deadline_s + 1)
        h2.service.tick()
        assert h2.service.blocks[0].rounds.version == 1
        for k, w in h2.weights(0).items():
            assert torch.allclose(w - base[k], sent.sent[k], atol=1e-6), k
    finally:
        h2.state.close()


def test_a_worker_told_another_wire_re_registers_and_follows_it(tmp_path, monkeypatch):
    """An aggregator restarted with another --wire refuses the old codec (wrong_wire); the
    worker registers again, learns the new delta_wire and pushes in it."""
    from tests.protocol.worker.test_worker import SETTINGS

    h = make_harness(tmp_path / "s", SETTINGS.replace(delta_wire="int8"))
    c = client_for(h, h.alice)
    real = c.register
    calls = []

    def stale_first(*args, **kwargs):
        reg = real(*args, **kwargs)
        calls.append(reg.delta_wire)
        return replace(reg, delta_wire="fp16") if len(calls) == 1 else reg

    monkeypatch.setattr(c, "register", stale_first)
    try:
        report = WorkerLoop(c, lambda reg, cfg: FakeTrainer(), block=0).run()
        assert report.refused == {"wrong_wire": 1} and report.accepted >= 3, report
        assert calls == ["int8", "int8"]
    finally:
        h.state.close()


def test_the_selecting_codecs_are_the_top_k_ones() -> None:
    # the settings refuse outer momentum with exactly these (their residual carries the rest)
    assert [
        w for w in ("fp16", "int8", "topk:0.03", "sparse:0.03:2") if DeltaWire.parse(w).selects
    ] == [
        "topk:0.03",
        "sparse:0.03:2",
    ]
