"""`tensorwire.decode` parses safetensors itself, from a view of the body (no copy): held here
to safetensors' own parser (`safetensors.deserialize`) on valid and corrupted bodies. Whatever
it accepts, safetensors accepts with the same tensors and metadata; whatever safetensors
refuses, it refuses. It is stricter in two places only: a repeated JSON key, and dtype codes
no BlockTrain reader takes (sub-byte floats)."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from safetensors import SafetensorError, deserialize

from blocktrain.tensorwire import BITS, WireError, decode, encode

Reading = tuple[dict[str, tuple[str, tuple[int, ...], bytes]], dict]


def body_of(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def reference(body: bytes) -> Reading | None:
    """safetensors' reading of a body (None: refused), metadata read as tensorwire reads it."""
    try:
        entries = deserialize(body)
    except (SafetensorError, ValueError, OverflowError, TypeError):
        return None
    (n,) = struct.unpack("<Q", body[:8])
    meta = json.loads(body[8 : 8 + n]).get("__metadata__") or {}
    return {k: (v["dtype"], tuple(v["shape"]), bytes(v["data"])) for k, v in entries}, meta


def ours(body: bytes) -> Reading | None:
    try:
        d = decode(bytearray(body))
    except WireError as exc:
        assert exc.reason in ("malformed", "pickle"), exc.reason
        return None
    return {k: (t.dtype, t.shape, bytes(t.data)) for k, t in d.tensors.items()}, d.metadata


def valid_body(rng: random.Random) -> bytes:
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32, torch.uint8]
    tensors = {}
    for i in range(rng.randint(0, 4)):
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        tensors[f"t{i}"] = torch.zeros(shape, dtype=rng.choice(dtypes)).random_(0, 100)
    return encode(tensors, {"block": str(rng.randint(0, 9)), "round": "3"})


FIELD_VALUES = [
    "F64", "F4", "XX", 7, None, [], [0], [1, 2], [-1, 2], [0, 1 << 64], [2**63, 2**63],
    [1.0, 2], [True, 0], [0, 0, 0],
]  # fmt: skip


def corrupt(body: bytes, rng: random.Random) -> bytes:
    """A byte changed, cut or inserted anywhere; or a field of a tensor's header entry
    rewritten."""
    (n,) = struct.unpack("<Q", body[:8])
    kind = rng.randrange(5)
    if kind == 0 and n:
        i = 8 + rng.randrange(n)
        return body[:i] + bytes([rng.randrange(256)]) + body[i + 1 :]
    if kind == 1:
        i = rng.randrange(len(body) + 1)
        return body[:i] + body[i + rng.randint(1, 8) :]
    if kind == 2:
        i = rng.randrange(len(body) + 1)
        return body[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 4))) + body[i:]
    try:
        header = json.loads(body[8 : 8 + n])
        names = [k for k in header if k != "__metadata__"]
    except (ValueError, TypeError, AttributeError):
        return body + b"\x00"
    if not names:
        return body + b"\x00"
    info = header[rng.choice(names)]
    info[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(FIELD_VALUES)
    return body_of(header, body[8 + n :])


def test_same_verdicts_as_safetensors_on_corrupted_bodies():
    rng = random.Random(0)
    accepted = refused = 0
    for _ in range(3000):
        body = valid_body(rng)
        for _ in range(rng.randint(0, 2)):
            body = corrupt(body, rng)
        mine, theirs = ours(body), reference(body)
        if mine is not None:
            assert theirs == mine, body[:200]
            accepted += 1
            continue
        refused += 1
        if theirs is not None:  # only the documented strictness may differ
            (n,) = struct.unpack("<Q", body[:8])
            assert b'"F4"' in body[8 : 8 + n], body[:200]
    assert accepted > 500 and refused > 500  # both sides of the line were exercised


@pytest.mark.parametrize(
    "header, data",
    [
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 4),
        ({"a": {"dtype": "F16", "shape": [], "data_offsets": [0, 2]}}, b"\x00" * 2),
        ({"a": {"dtype": "F16", "shape": [0, 3], "data_offsets": [0, 0]}}, b""),
        ({"__metadata__": None}, b""),
        (b"  {}  ", b""),
        ({"b": {"dtype": "I8", "shape": [1], "data_offsets": [1, 2]},
          "a": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1], "extra": 1}}, b"\x01\x02"),
    ],
)  # fmt: skip
def test_valid_edge_cases_agree(header, data):
    body = body_of(header, data)
    assert reference(body) is not None
    assert ours(body) == reference(body)


@pytest.mark.parametrize(
    "header, data",
    [
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 5),  # extra
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 3),  # short
        ({"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}, b"\x00" * 4),  # shape
        ({"a": {"dtype": "F16", "shape": [1], "data_offsets": [2, 4]}}, b"\x00" * 4),  # gap
        ({"a": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]},
          "b": {"dtype": "I8", "shape": [2], "data_offsets": [1, 3]}}, b"\x00" * 3),  # overlap
        ({"a": {"dtype": "F16", "shape": [2**62, 4], "data_offsets": [0, 0]}}, b""),  # overflow
        ({"a": {"dtype": "F16", "shape": [1]}}, b"\x00" * 2),  # no offsets
        ({"__metadata__": {"block": 1}}, b""),  # not a string
        ({"__metadata__": []}, b""),
        (b"[]", b""),
        (b'{"a": NaN}', b""),
        (b'{"__metadata__": {"k": "\\ud800"}}', b""),  # a lone surrogate is not UTF-8
        (b"\xff{}", b""),
    ],
)  # fmt: skip
def test_invalid_edge_cases_agree(header, data):
    body = body_of(header, data)
    assert reference(body) is None
    assert ours(body) is None


def test_a_header_length_beyond_the_body_or_the_cap():
    assert ours(struct.pack("<Q", 100_000_001) + b"{}") is None
    assert ours(struct.pack("<Q", 3) + b"{}") is None


def test_stricter_on_repeated_keys_and_sub_byte_dtypes():
    entry = b'"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}'
    twice = b"{" + entry + b"," + entry + b"}"
    sub_byte = {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}
    for body in (body_of(twice, b"\x00"), body_of(sub_byte, b"\x00")):
        assert reference(body) is not None
        assert ours(body) is None
    assert "F4" not in BITS


def test_tensors_share_a_writable_body_and_copy_a_read_only_one():
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    body = bytearray(encode({"t": t}, {}))
    shared = decode(body).tensors["t"].to_torch()
    torch.testing.assert_close(shared, t)
    body[-2:] = torch.tensor([100.0], dtype=torch.float16).numpy().tobytes()
    assert float(shared[1, 2]) == 100.0  # a view of the body: the change shows
    copied = decode(bytes(body)).tensors["t"].to_torch()
    assert copied.data_ptr() != shared.data_ptr()
    torch.testing.assert_close(copied, shared)


def test_misaligned_data_is_copied_to_an_aligned_tensor():
    t = torch.arange(3, dtype=torch.float32)
    body = encode({"t": t}, {})
    (n,) = struct.unpack("<Q", body[:8])
    for pad in range(1, 4):  # headers padded by 1..3 spaces: at least one misaligns the data
        odd = bytearray(struct.pack("<Q", n + pad) + body[8 : 8 + n] + b" " * pad + body[8 + n :])
        raw = decode(odd).tensors["t"]
        out = raw.to_torch()
        assert out.data_ptr() % 4 == 0
        torch.testing.assert_close(out, t)
