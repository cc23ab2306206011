"""A push's body is copied once, into one buffer sized by its Content-Length
(`httpserve.read_body`), and then read in place: the delta the aggregator validates and
accumulates is a view of that buffer (`tensorwire.decode` over a bytearray)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from blocktrain.httpserve import read_body
from tests.protocol.conftest import delta_body


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _read(parts: list[bytes], length: int | None) -> bytearray:
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    return asyncio.run(read_body({"headers": headers}, _chunks(parts)))


def test_read_body_fills_a_buffer_of_the_declared_length():
    parts = [b"abc", b"", b"defgh", b"i"]
    out = _read(parts, 9)
    assert isinstance(out, bytearray) and out == b"abcdefghi"


def test_read_body_grows_without_a_declared_length_and_trims_a_short_body():
    assert _read([b"ab", b"cd"], None) == b"abcd"
    assert _read([b"ab"], 10) == b"ab"
    assert _read([b"abcdef"], 3) == b"abcdef"  # more than declared is kept, never lost


def test_the_validated_delta_is_a_view_of_the_request_buffer(harness):
    w = harness.register(harness.alice, block=0)["worker_id"]
    harness.pull(harness.alice, w, 0)
    body = bytearray(delta_body(0, worker=w))
    start = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    checked = harness.service.engine.check(0, body, w)
    assert checked.verdict.accepted, checked.verdict
    assert checked.candidate is not None
    for name, t in checked.candidate.tensors.items():
        assert start <= t.data_ptr() < start + len(body), f"{name} was copied"


def test_a_push_through_the_route_is_accepted_and_applied(harness):
    w = harness.register(harness.alice, block=0)["worker_id"]
    harness.pull(harness.alice, w, 0)
    before = harness.weights(0)
    r = harness.push(harness.alice, w, 0, delta_body(0, worker=w, scale=0.02))
    assert r.status_code == 200, r.text
    after = harness.weights(0)  # the only replica reported: the round closed with its delta
    torch.testing.assert_close(
        after["embed"] - before["embed"], torch.full((5, 4), 0.02), atol=1e-4, rtol=0
    )
