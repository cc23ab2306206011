"""Hypothesis strategies for safetensors bodies, valid and malformed: the schema says only
"binary" for them, so schemathesis alone would send random bytes and never reach past the
parser. Each strategy starts from a body the server accepts and breaks one thing."""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import strategies as st

DTYPES = ["F16", "BF16", "F32", "U8", "F64", "I64", "BOOL", "F8_E4M3", "", "f32", "Z9"]
"""Safetensors dtype codes: the four BlockTrain reads, others the parser knows, and nonsense."""

ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "U8": 1, "F64": 8, "I64": 8, "BOOL": 1, "F8_E4M3": 1}


def raw_safetensors(header: Any, data: bytes = b"", header_len: int | None = None) -> bytes:
    """A body built by hand: `header` (a JSON value, or raw bytes) after an 8-byte length that
    may lie (`header_len`), then `data`."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(text) if header_len is None else header_len
    return struct.pack("<Q", size) + text + data


def split(body: bytes) -> tuple[dict[str, Any], bytes]:
    """A well-formed body -> (its header as JSON, its data)."""
    (n,) = struct.unpack("<Q", body[:8])
    return json.loads(body[8 : 8 + n]), body[8 + n :]


def nested(depth: int) -> str:
    """JSON nested `depth` levels deep: deep enough, it overflows a recursive parser."""
    return "[" * depth + "]" * depth


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON value, small."""

NUMBERISH = st.sampled_from(
    ["-1", "0", "1", "1e309", "nan", "inf", " 1", "1.5", "0x10", "99999999999999999999", "", "ü"]
) | st.integers(min_value=-(2**64), max_value=2**64).map(str)
"""Strings a server might parse as numbers, and some it must not."""


@st.composite
def tensor_entries(draw: st.DrawFn, max_tensors: int = 3) -> tuple[dict[str, Any], bytes]:
    """A header's tensor entries with consistent offsets (or not), and their data."""
    header: dict[str, Any] = {}
    data = b""
    for i in range(draw(st.integers(0, max_tensors))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        n = 1
        for d in shape:
            n *= d
        size = n * ITEMSIZE.get(dtype, 1)
        if draw(st.integers(0, 4)) == 0:  # lie about the size
            size = draw(st.integers(0, 64))
        blob = draw(st.binary(min_size=size, max_size=size))
        header[draw(st.sampled_from(["x", "z", "h", "generator", "logits", f"t{i}"]))] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(blob)],
        }
        data += blob
    return header, data


def malformed(base: bytes, metadata: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    """Bodies derived from the well-formed `base`: truncated, lying lengths, wrong dtypes and
    shapes, nested or non-string metadata, generated metadata (`metadata` draws the
    `__metadata__` object), pickles and zips, flipped bytes."""
    header, data = split(base)
    meta = header.get("__metadata__", {})
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}

    def with_meta(m: Any) -> bytes:
        return raw_safetensors({"__metadata__": m, **tensors}, data)

    def retyped(dtype: str) -> bytes:
        return raw_safetensors(
            {**header, **{k: {**v, "dtype": dtype} for k, v in tensors.items()}}, data
        )

    def reshaped(shape: list[int]) -> bytes:
        return raw_safetensors(
            {**header, **{k: {**v, "shape": shape} for k, v in tensors.items()}}, data
        )

    def flipped(args: tuple[int, int]) -> bytes:
        pos, value = args
        out = bytearray(base)
        out[pos % len(out)] = value
        return bytes(out)

    def entries(parts: tuple[dict[str, Any], bytes]) -> bytes:
        return raw_safetensors({"__metadata__": meta, **parts[0]}, parts[1])

    return st.one_of(
        st.integers(0, len(base) - 1).map(lambda n: base[:n]),  # truncated
        st.integers(len(base), 2**64 - 1).map(lambda n: struct.pack("<Q", n) + base[8:]),
        st.sampled_from([2**63, 2**64 - 1, 100_000_001]).map(
            lambda n: raw_safetensors(header, data, n)
        ),
        st.sampled_from(DTYPES).map(retyped),
        st.lists(st.integers(0, 2**40), max_size=4).map(reshaped),
        st.integers(1, 200_000).map(lambda d: with_meta({**meta, "blocktrain": nested(d)})),
        st.integers(1, 200_000).map(lambda d: raw_safetensors(nested(d).encode(), data)),
        JSON_VALUES.map(with_meta),  # non-string metadata, lists, numbers, null
        st.dictionaries(st.sampled_from(sorted(meta) or ["k"]), JSON_VALUES, max_size=4).map(
            lambda m: with_meta({**meta, **m})
        ),
        metadata.map(with_meta),
        st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)).map(flipped),
        tensor_entries().map(entries),
        st.sampled_from(
            [
                b"",
                b"\x80\x04\x95" + base[3:],  # a pickle's opening
                b"PK\x03\x04" + base[4:],  # a zip (torch.save)
                raw_safetensors(b"\xff\xfe{}"),  # not UTF-8
                raw_safetensors(b'{"a": 1, "a": 2}'),
                raw_safetensors([1, 2, 3]),
                raw_safetensors({"__metadata__": "x"}),
                raw_safetensors({"__metadata__": {"__metadata__": {"x": "y"}}}),
            ]
        ),
    )
