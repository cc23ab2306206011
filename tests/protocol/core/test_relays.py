"""The relay pool (protocol/core/relays.py): which stream a worker of the next block takes."""

from __future__ import annotations

import pytest
import torch

from blocktrain.protocol.core.relays import RelayPool, keeps_stream
from blocktrain.protocol.core.verdict import Verdict
from blocktrain.relaystream import Shape, StreamWriter
from blocktrain.tensorwire import WireError

SHAPE = Shape(2, 4, 8)


def stream(steps: int = 1, fill: float = 1.0) -> bytes:
    writer = StreamWriter(SHAPE)
    for _ in range(steps):
        writer.add(torch.zeros(2, 4, dtype=torch.long), torch.full((2, 4, 8), fill))
    return writer.finish({}).read()


def test_takers_get_the_newest_round_spread_over_its_replicas_and_never_twice() -> None:
    pool = RelayPool(0, SHAPE)
    pool.put(0, worker=1, body=stream())
    pool.put(0, worker=2, body=stream())
    first, second = pool.take(10), pool.take(11)
    assert first is not None and second is not None
    assert {first.worker, second.worker} == {1, 2}, "two takers, two replicas' sequences"
    third = pool.take(12)
    assert third is not None and third.round == 0, "then the least handed out"
    pool.take(10)
    assert pool.take(10) is None, "a taker never trains on a stream twice"
    pool.put(1, worker=2, body=stream())
    newest = pool.take(12)
    assert newest is not None and (newest.round, newest.worker) == (1, 2), "the newest round"
    again = pool.take(10, reuse=True)
    assert again is not None, "with reuse, the newest stream once more"


def test_the_pool_keeps_its_last_rounds_and_its_byte_cap() -> None:
    pool = RelayPool(0, SHAPE, keep=2)
    for r in range(4):
        pool.put(r, worker=1, body=stream())
    assert sorted(s.round for s in pool._streams.values()) == [2, 3]
    one = len(stream())
    capped = RelayPool(0, SHAPE, max_bytes=one)
    capped.put(0, worker=1, body=stream())
    capped.put(0, worker=2, body=stream())
    assert capped.nbytes <= one, "the oldest go first"


def test_a_stream_of_another_shape_is_refused() -> None:
    pool = RelayPool(0, Shape(2, 4, 16))
    with pytest.raises(WireError) as err:
        pool.put(0, worker=1, body=stream())
    assert err.value.reason == "bad_shape"


def test_a_delta_refused_for_its_content_loses_its_stream() -> None:
    assert keeps_stream(Verdict.ok())
    assert keeps_stream(Verdict.refuse("late", "after the deadline"))
    assert not keeps_stream(Verdict.refuse("norm_too_large", "too big"))
    assert not keeps_stream(Verdict.refuse("harmful", "raised the loss"))
