"""safetensors bodies: round trips, casting, and every way a body can be unreadable."""

from __future__ import annotations

import io
import json
import pickle
import struct

import pytest
import torch

from blocktrain.protocol.core.bodies import WireError, decode, encode, metadata_int
from blocktrain.tensorwire import looks_like_pickle


def tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7, "b": torch.ones(4)}


@pytest.mark.parametrize(
    ("dtype", "torch_dtype", "code"),
    [
        ("fp16", torch.float16, "F16"),
        ("bf16", torch.bfloat16, "BF16"),
        ("fp32", torch.float32, "F32"),
    ],
)
def test_round_trip_casts_to_the_wire_dtype(dtype, torch_dtype, code):
    body = encode(tensors(), {"block": 1, "round": 7}, dtype)
    got = decode(body)
    assert got.metadata == {"block": "1", "round": "7"}
    assert {raw.dtype for raw in got.tensors.values()} == {code}
    out = got.to_torch()
    for name, t in tensors().items():
        assert out[name].dtype == torch_dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t.to(torch_dtype)), name


def test_fp16_halves_the_bytes():
    big = {"w": torch.randn(256, 256)}
    assert len(encode(big, {}, "fp16")) < 0.51 * len(encode(big, {}, "fp32"))


def test_size_limit():
    body = encode(tensors(), {})
    decode(body, max_bytes=len(body))
    with pytest.raises(WireError) as exc:
        decode(body, max_bytes=len(body) - 1)
    assert exc.value.reason == "too_large"


def test_pickles_are_refused_by_name():
    buf = io.BytesIO()
    torch.save(tensors(), buf)
    for body in (pickle.dumps(tensors()), pickle.dumps({"x": 1}, protocol=2), buf.getvalue()):
        assert looks_like_pickle(body)
        with pytest.raises(WireError) as exc:
            decode(body)
        assert exc.value.reason == "pickle"


def test_a_header_length_that_starts_like_a_pickle_is_still_safetensors():
    """A header of 640 bytes is `80 02 00 ...` in little-endian, the opening of a protocol 2
    pickle; the body is read all the same (a 640-byte header was refused as a pickle)."""
    for target in (640, 896, 1152, 1408):
        meta = {"pad": ""}
        body = encode(tensors(), meta)
        while int.from_bytes(body[:8], "little") < target:
            meta["pad"] += "x"
            body = encode(tensors(), meta)
        assert int.from_bytes(body[:8], "little") == target, "safetensors pads to 8 bytes"
        assert body[0] == 0x80 and not looks_like_pickle(body)
        assert decode(body).metadata["pad"] == meta["pad"]


@pytest.mark.parametrize("cut", [0, 3, 8, 20, -1])
def test_truncated_bodies_are_malformed(cut):
    body = encode(tensors(), {"block": 0})
    with pytest.raises(WireError) as exc:
        decode(body[:cut])
    assert exc.value.reason == "malformed", exc.value.detail


@pytest.mark.parametrize(
    "body",
    [
        b"hello world, not safetensors",
        struct.pack("<Q", 1 << 40) + b"{}",  # absurd header length
        struct.pack("<Q", 2) + b"{}" + b"extra",  # data not covered
        struct.pack("<Q", 5) + b"nojsn",
        b"\x00" * 64,
    ],
)
def test_garbage_is_malformed(body):
    with pytest.raises(WireError) as exc:
        decode(body)
    assert exc.value.reason == "malformed"


def test_metadata_must_be_strings():
    header = json.dumps({"__metadata__": {"block": 1}}).encode()
    with pytest.raises(WireError) as exc:
        decode(struct.pack("<Q", len(header)) + header)
    assert exc.value.reason in ("malformed", "bad_metadata")


def test_metadata_int():
    assert metadata_int({"round": " 12 "}, "round") == 12
    for meta in ({}, {"round": "1.5"}, {"round": "x"}, {"round": "9" * 5000}):
        with pytest.raises(WireError) as exc:
            metadata_int(meta, "round")
        assert exc.value.reason == "bad_metadata"


def test_no_unpickling_anywhere_in_the_protocol():
    from pathlib import Path

    import blocktrain.protocol as protocol

    for path in Path(protocol.__file__).parent.rglob("*.py"):
        text = path.read_text()
        for banned in ("torch.load", "pickle.load", "import pickle", "weights_only"):
            assert banned not in text, f"{path.name} mentions {banned}"
