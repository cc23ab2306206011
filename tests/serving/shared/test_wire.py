"""The wire format: safetensors bodies with a JSON header, and nothing else accepted."""

from __future__ import annotations

import pytest
import torch

from blocktrain.serving.shared.serving_errors import (
    HostRefused,
    HostUnavailable,
    SessionLost,
    error_from_json,
)
from blocktrain.serving.shared.wire import SweepHeader, WireError, decode, encode


def test_round_trip_keeps_tensors_bit_for_bit_and_the_header():
    z = torch.randn(2, 4, 8)
    x = torch.randint(0, 256, (2, 5)).to(torch.uint8)
    tensors, header = decode(encode({"z": z, "x": x}, {"step": 3, "route": ["http://a:1"]}))
    assert torch.equal(tensors["z"], z) and tensors["z"].dtype == torch.float32
    assert torch.equal(tensors["x"], x)
    assert header == {"step": 3, "route": ["http://a:1"]}


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00" * 7,
        b"\xff" * 16,
        (5).to_bytes(8, "little") + b"{bad}",
        b"\x10" + b"\x00" * 7 + b"{}",
    ],
)
def test_garbage_is_a_wire_error(body):
    with pytest.raises(WireError):
        decode(body)


def test_pickles_and_other_dtypes_are_refused_with_their_reason():
    import io
    import pickle

    with pytest.raises(WireError, match="never unpickles") as exc:
        decode(pickle.dumps({"z": [1.0]}))
    assert exc.value.reason == "pickle"
    buf = io.BytesIO()
    torch.save({"z": torch.zeros(2)}, buf)
    with pytest.raises(WireError, match=r"pickle or torch\.save"):
        decode(buf.getvalue())
    with pytest.raises(WireError, match="I64") as exc:
        decode(encode({"x": torch.zeros(2, 3, dtype=torch.int64)}))
    assert exc.value.reason == "bad_dtype"


def test_headers_are_strict():
    with pytest.raises(ValueError):
        SweepHeader.model_validate({"model": "m", "fingerprint": "f", "step": 0, "extra": 1})
    with pytest.raises(ValueError):
        SweepHeader.model_validate({"model": "m", "fingerprint": "f", "step": -1})


def test_errors_keep_the_host_that_failed_across_hops():
    body = {
        "error": {
            "message": "host http://c:3 is unavailable",
            "code": "host_unavailable",
            "host": "http://c:3",
        }
    }
    err = error_from_json(503, body, default_host="http://b:2")
    assert isinstance(err, HostUnavailable) and err.host == "http://c:3" and err.status == 503
    assert isinstance(
        error_from_json(
            409, {"error": {"message": "m", "code": "session_lost"}}, default_host="http://b:2"
        ),
        SessionLost,
    )
    other = error_from_json(500, "Internal Server Error", default_host="http://b:2")
    assert isinstance(other, HostRefused) and other.host == "http://b:2"
