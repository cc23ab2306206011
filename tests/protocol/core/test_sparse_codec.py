"""The sparse codec (`--wire sparse:DENSITY[:BITS]`, `protocol.core.codecs`): chunked top-k, low-bit
values with a scale per chunk, packed indices; its wire format as docs/protocol.md (Sparse
deltas) writes it, error feedback with decay, its bytes, its refusals, and pulls in it."""

from __future__ import annotations

import math

import pytest
import torch

from blocktrain import tensorwire
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.bodies import decode as decode_body
from blocktrain.protocol.core.bodies import update_body
from blocktrain.protocol.core.codecs import DeltaEncoder, compress, data_bytes, declared
from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.protocol.core.events import accumulator
from blocktrain.protocol.core.pulls import Views, read_delta
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.sparse_codec import layout, pack, unpack
from blocktrain.protocol.core.validation import BlockSpec, Candidate, Limits, validate
from blocktrain.protocol.core.verdict import REASONS
from tests.protocol.conftest import block_tensors

# edge tiles on both axes, a 3-d tensor, a vector of several flat chunks, a 0-d tensor
SHAPES = {"w": (130, 70), "e": (9, 3, 50), "b": (5000,), "s": ()}
LIMITS = Limits(max_delta_norm=1e4, max_tokens=1000)
WIRE = "sparse:0.05:4"


def delta(seed: int = 0, shapes=SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def judge(body: bytes, wire: str, shapes=SHAPES):
    c = Candidate(1, decode_body(body), BlockSpec(shapes, "fp16", wire), LIMITS)
    return validate(c), c


def body_of(parts: dict[str, torch.Tensor], tag: str | None = WIRE) -> bytes:
    meta = {"block": "1", "base_version": "0", "round": "0", "tokens": "10"}
    if tag is not None:
        meta["delta_wire"] = tag
    return tensorwire.encode(parts, meta)


def chunks(x: torch.Tensor, c: int):
    """(chunk values flat, a function from chunk-local index to flat index of x), row-major over
    the tile grid as docs/protocol.md says."""
    if x.dim() >= 2:
        m = x.reshape(x.shape[0], -1)
        th, tw = c, c
    else:
        m = x.reshape(1, -1)
        th, tw = 1, c * c
    rows, cols = m.shape
    for r0 in range(0, rows, th):
        for c0 in range(0, cols, tw):
            tile = m[r0 : r0 + th, c0 : c0 + tw]
            w = tile.shape[1]
            yield tile.reshape(-1), (lambda i, r0=r0, c0=c0, w=w: (r0 + i // w) * cols + c0 + i % w)


# ---------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("text", "density", "bits", "chunk", "beta", "canonical"),
    [
        ("sparse:0.03", 0.03, 4, 64, 1.0, "sparse:0.03:4"),
        ("sparse:0.03:2", 0.03, 2, 64, 1.0, "sparse:0.03:2"),
        ("sparse:0.1:8:chunk=32", 0.1, 8, 32, 1.0, "sparse:0.1:8:chunk=32"),
        ("sparse:0.1:beta=0.95", 0.1, 4, 64, 0.95, "sparse:0.1:4:beta=0.95"),
        ("sparse:0.1:2:beta=0.9:chunk=16", 0.1, 2, 16, 0.9, "sparse:0.1:2:chunk=16:beta=0.9"),
    ],
)
def test_sparse_wire_names_parse(text, density, bits, chunk, beta, canonical):
    wire = DeltaWire.parse(text)
    assert (wire.kind, wire.ratio, wire.bits, wire.chunk, wire.beta) == (
        "sparse",
        density,
        bits,
        chunk,
        beta,
    )
    assert str(wire) == canonical and DeltaWire.parse(str(wire)) == wire
    assert "beta" not in wire.tag and DeltaWire.parse(wire.tag).beta == 1.0
    assert wire.same_body(wire.tag) and wire.lossy and wire.sparse
    settings = AggregatorSettings(delta_wire=text)
    assert settings.push_wire == text and DeltaWire.parse(settings.pulls).sparse  # denser
    assert AggregatorSettings(pull_wire=text).pulls == text


@pytest.mark.parametrize(
    "text",
    [
        "sparse",
        "sparse:0",
        "sparse:1",
        "sparse:x",
        "sparse:0.1:3",
        "sparse:0.1:16",
        "sparse:0.1:chunk=1",
        "sparse:0.1:chunk=2048",
        "sparse:0.1:beta=1.5",
        "sparse:0.1:beta=-0.1",
        "sparse:0.1:gamma=1",
        "sparse:0.1:chunk=8:chunk=16",
        "sparse:0.1:4:2",
    ],
)
def test_bad_sparse_wire_names_are_refused_with_what_is_accepted(text):
    with pytest.raises(ValueError, match=r"sparse:DENSITY\[:BITS\]"):
        DeltaWire.parse(text)
    with pytest.raises(ConfigError, match=r"delta_wire = .* must be fp16"):
        AggregatorSettings(delta_wire=text)
    with pytest.raises(ConfigError, match=r"pull_wire"):
        AggregatorSettings(pull_wire=text)


def test_a_body_names_its_layout_and_the_aggregator_reads_it_however_written():
    wire = DeltaWire.parse("sparse:0.03:2:beta=0.9")
    assert wire.tag == "sparse:0.03:2"
    assert wire.same_body("sparse:0.030:2:chunk=64") and wire.same_body("sparse:3e-2:2")
    assert not wire.same_body("sparse:0.03:4") and not wire.same_body("sparse:0.03:2:chunk=32")
    assert not wire.same_body("sparse") and not wire.same_body("topk")
    assert declared({"delta_wire": "sparse:0.03:2"}) == DeltaWire.parse("sparse:0.03:2")
    assert declared({"delta_wire": "topk"}).kind == "topk" and declared({}).kind == "fp16"


# ---------------------------------------------------------------------- the format


def test_packing_is_little_endian_bit_by_bit_as_documented():
    two = pack(torch.tensor([1, 2, 3, 0, 3]), 2)
    assert two.dtype == torch.uint8 and two.tolist() == [0b00111001, 0b00000011]
    twelve = pack(torch.tensor([0xABC, 0x123]), 12)
    assert twelve.tolist() == [0xBC, 0x3A, 0x12]
    codes, clean = unpack(twelve, 12, 2)
    assert codes.tolist() == [0xABC, 0x123] and clean
    gen = torch.Generator().manual_seed(0)
    for bits in (1, 2, 3, 4, 8, 12, 16):
        x = torch.randint(0, 1 << bits, (37,), generator=gen)
        packed = pack(x, bits)
        assert packed.numel() == math.ceil(37 * bits / 8)
        assert torch.equal(unpack(packed, bits, 37)[0], x), bits
    assert not unpack(torch.tensor([0b00111001, 0b00010011], dtype=torch.uint8), 2, 5)[1]


def test_the_layout_cuts_tiles_and_flat_chunks():
    wire = DeltaWire.parse("sparse:0.03:2")
    lay = layout((130, 70), wire)
    assert lay.grid == (3, 2) and lay.chunks == 6
    assert lay.heights == (64, 64, 64, 64, 2, 2) and lay.widths == (64, 6, 64, 6, 64, 6)
    assert lay.ks == tuple(
        max(1, math.ceil(0.03 * h * w)) for h, w in zip(lay.heights, lay.widths, strict=True)
    )
    assert layout((5000,), wire).widths == (4096, 904) and layout((), wire).ks == (1,)
    assert wire.index_bits == 12 and DeltaWire.parse("sparse:0.1:chunk=16").index_bits == 8


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_round_trip_keeps_exactly_the_top_k_of_each_chunk_within_the_quantisation_error(bits):
    text = f"sparse:0.05:{bits}:chunk=32"
    wire = DeltaWire.parse(text)
    d = delta(1)
    d["w"][64:96, 32:64] = 0.0  # an all-zero chunk: scale 0, it sends zeros
    out = compress(d, wire)
    verdict, c = judge(update_body(1, d, base_version=0, round=0, tokens=10, dtype=text), text)
    assert verdict.accepted, verdict
    levels = 1 << (bits - 1)
    for name, x in d.items():
        assert torch.equal(c.tensors[name], out.sent[name]), name  # decode == what was sent
        got = c.tensors[name].reshape(-1)
        seen = 0
        for values, flat_index in chunks(x, 32):
            n = values.numel()
            k = min(n, max(1, math.ceil(0.05 * n)))
            top = values.abs().argsort(descending=True)[:k].tolist()
            kept = {flat_index(i) for i in top}
            scale = float(values.abs().max().half())
            nonzero = {flat_index(i) for i in range(n) if got[flat_index(i)] != 0}
            assert nonzero == (kept if scale > 0 else set()), (name, seen)
            for i in top:
                err = abs(float(got[flat_index(i)]) - float(values[i]))
                v = abs(float(values[i]))
                bound = scale / (2 * levels) if v >= scale / (2 * levels) else scale / levels
                assert err <= bound + 1e-3 * scale + 1e-7, (name, i, err, bound)
            seen += k
        assert seen == layout(tuple(x.shape), wire).kept


def test_bits_per_parameter_on_a_256_by_1024_matrix():
    """The whole push body, safetensors header and metadata included."""
    big = {"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))}
    n = big["w"].numel()
    bits = {}
    for text in ("sparse:0.03:2", "sparse:0.1:4", "fp16"):
        body = update_body(0, big, base_version=0, round=0, tokens=1, dtype=text)
        bits[text] = 8 * len(body) / n
        data = data_bytes({"w": (256, 1024)}, DeltaWire.parse(text))
        assert data < len(body) < data + 1024, text
    # 64 chunks x 123 kept: 2 + 12 bits a kept value, 16 bits a chunk
    assert 0.42 < bits["sparse:0.03:2"] < 0.5, bits
    assert 1.6 < bits["sparse:0.1:4"] < 1.7, bits
    assert bits["fp16"] / bits["sparse:0.03:2"] > 30, bits


# ---------------------------------------------------------------------- error feedback


def test_error_feedback_sends_everything_in_the_end():
    encoder = DeltaEncoder("sparse:0.05:2")
    true = {k: torch.zeros(s) for k, s in SHAPES.items()}
    sent = {k: torch.zeros(s) for k, s in SHAPES.items()}
    for r in range(5):
        d = delta(10 + r)
        out = encoder.compress(d)
        assert out.wire.kind == "sparse"
        assert encoder.residual is not None
        for k in SHAPES:
            true[k] += d[k]
            sent[k] += out.sent[k]
            assert torch.allclose(sent[k] + encoder.residual[k], true[k], atol=1e-4), (r, k)


def test_error_feedback_decays_with_beta():
    beta = 0.5
    encoder = DeltaEncoder(f"sparse:0.05:2:beta={beta}")
    d0, d1 = delta(20), delta(21)
    out0 = encoder.compress(d0)
    assert encoder.residual is not None
    r0 = {k: v.clone() for k, v in encoder.residual.items()}
    for k in SHAPES:
        assert torch.allclose(r0[k], d0[k] - out0.sent[k]), k  # nothing to decay yet
    out1 = encoder.compress(d1)
    for k in SHAPES:  # what was compressed: the new delta plus beta x the old residual
        assert torch.allclose(encoder.residual[k] + out1.sent[k], d1[k] + beta * r0[k]), k
    r1 = {k: v.clone() for k, v in encoder.residual.items()}
    zero = {k: torch.zeros(s) for k, s in SHAPES.items()}
    out2 = encoder.compress(zero)  # nothing new: only the decayed residual is left to send
    for k in SHAPES:
        assert torch.allclose(encoder.residual[k] + out2.sent[k], beta * r1[k]), k
    plain = DeltaEncoder("sparse:0.05:2")  # beta 1: plain accumulation, as topk
    plain.compress(d0)
    assert plain.residual is not None
    r = {k: v.clone() for k, v in plain.residual.items()}
    out = plain.compress(d1)
    for k in SHAPES:
        assert torch.allclose(plain.residual[k] + out.sent[k], d1[k] + r[k]), k


# ---------------------------------------------------------------------- refusals

SMALL = {"w": (70, 40), "b": (10,)}
SMALL_WIRE = "sparse:0.1:4"  # w: 2 x 1 tiles of 64 x 40 (k 256) and 6 x 40 (k 24); b: k 1


def s_parts(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    parts = dict(compress(delta(3, SMALL), DeltaWire.parse(SMALL_WIRE)).parts)
    parts.update({k.replace("__", "#"): v for k, v in changes.items()})
    return parts


def indices_with(first_chunk: list[int] | None = None, second: list[int] | None = None):
    """w's packed index stream with chunk 0's (256 indices) or chunk 1's (24) replaced."""
    wire = DeltaWire.parse(SMALL_WIRE)
    lay = layout(SMALL["w"], wire)
    assert lay.ks == (256, 24)
    local, _ = unpack(s_parts()["w#indices"], wire.index_bits, lay.kept)
    local = local.clone()
    if first_chunk is not None:
        local[: len(first_chunk)] = torch.tensor(first_chunk)
    if second is not None:
        local[256 : 256 + len(second)] = torch.tensor(second)
    return pack(local, wire.index_bits)


def with_padding_bit(name: str) -> torch.Tensor:
    packed = s_parts()[name].clone()
    packed[-1] |= 0x80
    return packed


@pytest.mark.parametrize(
    ("parts", "tag", "wire", "reason"),
    [
        # codec other than the announced one
        (s_parts(), "sparse:0.1:4", "topk:0.1", "wrong_wire"),
        (s_parts(), "sparse:0.1:4", "sparse:0.2:4", "wrong_wire"),
        (s_parts(), "sparse:0.1:2", SMALL_WIRE, "wrong_wire"),
        (s_parts(), "sparse", SMALL_WIRE, "wrong_wire"),
        (s_parts(), "", SMALL_WIRE, "wrong_wire"),
        # parts, their dtypes and lengths (chunk counts, stream lengths)
        ({k: v for k, v in s_parts().items() if k != "w#scales"}, None, None, "missing_tensors"),
        ({**s_parts(), "w#extra": torch.ones(1)}, None, None, "extra_tensors"),
        (s_parts(w__scales=torch.ones(3).half()), None, None, "bad_shape"),
        (s_parts(w__scales=torch.ones(2, 1).half()), None, None, "bad_shape"),
        (s_parts(w__values=torch.zeros(141, dtype=torch.uint8)), None, None, "bad_shape"),
        (s_parts(w__indices=torch.zeros(419, dtype=torch.uint8)), None, None, "bad_shape"),
        (s_parts(w__scales=torch.ones(2)), None, None, "bad_dtype"),
        (s_parts(w__values=torch.zeros(140, dtype=torch.int8)), None, None, "bad_dtype"),
        (s_parts(b__indices=torch.zeros(2, dtype=torch.int8)), None, None, "bad_dtype"),
        # scales
        (s_parts(w__scales=torch.tensor([1.0, math.nan]).half()), None, None, "bad_scales"),
        (s_parts(b__scales=torch.tensor([math.inf]).half()), None, None, "bad_scales"),
        (s_parts(w__scales=torch.tensor([-0.5, 1.0]).half()), None, None, "bad_scales"),
        (s_parts(w__scales=torch.full((2,), 60000.0).half()), None, None, "norm_too_large"),
        # indices: beyond the edge chunk (6 x 40 = 240 values), repeated, descending
        (s_parts(w__indices=indices_with(second=[240])), None, None, "bad_indices"),
        (s_parts(w__indices=indices_with(second=[4095])), None, None, "bad_indices"),
        (s_parts(w__indices=indices_with(first_chunk=[3, 3])), None, None, "bad_indices"),
        (s_parts(w__indices=indices_with(first_chunk=[9, 2])), None, None, "bad_indices"),
        (s_parts(b__indices=pack(torch.tensor([10]), 12)), None, None, "bad_indices"),
        # padding bits after the last entry
        (s_parts(b__values=with_padding_bit("b#values")), None, None, "malformed"),
        (s_parts(b__indices=with_padding_bit("b#indices")), None, None, "malformed"),
    ],
)
def test_malformed_sparse_bodies_are_refused_with_a_reason(parts, tag, wire, reason):
    tag = SMALL_WIRE if tag is None else (tag or None)  # "": no delta_wire (a dense body)
    verdict, _ = judge(body_of(parts, tag), wire or SMALL_WIRE, SMALL)
    assert not verdict.accepted and verdict.reason == reason, verdict
    assert verdict.detail
    assert 400 <= REASONS[reason][0] < 500


def test_an_index_may_end_its_chunk_and_chunks_may_use_the_same_local_index():
    """Index 239 is the edge chunk's last value; index 0 in two chunks is two coordinates."""
    parts = s_parts(w__indices=indices_with(list(range(256)), [0, *range(217, 240)]))
    verdict, c = judge(body_of(parts, SMALL_WIRE), SMALL_WIRE, SMALL)
    assert verdict.accepted, verdict
    w = c.tensors["w"]
    assert bool(w[0, 0] != 0) and bool(w[64, 0] != 0) and bool(w[69, 39] != 0)
    assert bool(w[69, 16] == 0)  # local 216 of the edge chunk was not sent
    assert int(w.count_nonzero()) == 280


# ---------------------------------------------------------------------- aggregation, pulls


def test_the_engine_averages_sparse_votes_per_coordinate_and_dense_ones_as_before():
    assert accumulator(AggregatorSettings(delta_wire="sparse:0.1:2")).per_coordinate
    for wire in ("fp16", "int8", "topk:0.1"):
        assert not accumulator(AggregatorSettings(delta_wire=wire)).per_coordinate


def test_a_chain_of_sparse_pulls_reaches_the_weights_bit_for_bit_named():
    """Error feedback in the view: each pull sends the largest of what the view still lacks,
    and the worker's view is the one the aggregator names (read_delta checks the id)."""
    views = Views("fp16")
    codec = DeltaWire.parse("sparse:0.1:4")
    w0 = block_tensors(2)
    gen = torch.Generator().manual_seed(5)
    target = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in w0.items()}
    held = views.whole(0, 0, w0)

    def gap() -> float:
        return max(float((held.tensors[k].float() - w).abs().max()) for k, w in target.items())

    start = gap()
    for v in range(1, 41):
        sent = views.delta(0, v, target, held.id, codec)
        assert tensorwire.decode(sent.body).metadata["delta_wire"] == "sparse:0.1:4"
        held = read_delta(sent.body, held, v, codec)
        assert held.id == sent.view.id
    assert gap() < 0.05 * start, (gap(), start)
