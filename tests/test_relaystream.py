"""Relayed streams (src/blocktrain/relaystream.py): the format, its checks, and reading a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from blocktrain.relaystream import (
    STEP,
    RelayStream,
    Shape,
    StreamWriter,
    bytes_per_step,
    check,
    dequantise,
    quantise,
    rotate,
    unrotate,
)
from blocktrain.tensorwire import WireError

SHAPE = Shape(batch=3, seq_len=8, d_model=16)


def steps(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (3, 8), generator=gen),
            torch.randn(3, 8, 16, generator=gen) * torch.rand(3, 8, 1, generator=gen) * 10,
        )
        for _ in range(n)
    ]


def written(batches, spool: Path | None = None) -> bytes:
    writer = StreamWriter(SHAPE, spool)
    for x, u in batches:
        writer.add(x, u)
    return writer.finish({"block": "0", "round": "4", "worker": "2"}).read()


def test_quantisation_errs_by_at_most_half_a_step_of_each_token_scale() -> None:
    u = torch.randn(5, 7, 16) * torch.logspace(-3, 3, 7)[None, :, None]
    q, scale = quantise(u)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    err = (dequantise(q, scale) - u).abs()
    # half a step of the token's own scale (and float32's rounding)
    bound = u.abs().amax(-1, keepdim=True) * (0.5 / 127 + 1e-6)
    assert bool((err <= bound).all()), "each token is quantised on its own scale"
    zero_q, zero_s = quantise(torch.zeros(2, 16))
    assert torch.equal(dequantise(zero_q, zero_s), torch.zeros(2, 16)), "an all-zero token"


@pytest.mark.parametrize("spooled", [False, True])
def test_a_stream_reads_back_step_by_step_from_memory_and_file(tmp_path, spooled) -> None:
    batches = steps(3)
    body = written(batches, tmp_path / "spool" if spooled else None)
    path = tmp_path / "stream.safetensors"
    path.write_bytes(body)
    for stream in (RelayStream.from_body(body, SHAPE), RelayStream.from_file(path, SHAPE)):
        assert stream.steps == 3
        assert stream.metadata["round"] == "4" and stream.metadata["worker"] == "2"
        for i in range(4):  # wraps around its steps
            x, u = stream.step(i)
            want_x, want_u = batches[i % 3]
            assert torch.equal(x, want_x) and x.dtype == torch.int64
            q, scale = quantise(want_u)
            assert torch.equal(u, dequantise(q, scale)), "exactly the int8 features sent"
    assert len(body) - bytes_per_step(3, 8, 16) * 3 < 512, "headers aside, N T (d + 3) a step"
    # an ordinary safetensors file: safetensors' own reader takes it
    tensors = load(body)
    assert tensors["features"].shape == (3, 3, 8, 16) and tensors["bytes"].dtype == torch.uint8


def test_the_writer_refuses_a_step_of_another_shape() -> None:
    writer = StreamWriter(SHAPE)
    with pytest.raises(ValueError, match="relayed step"):
        writer.add(torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, 16))
    with pytest.raises(ValueError, match="at least one step"):
        writer.finish({})


def _body(**tensors: torch.Tensor) -> bytes:
    base = {
        "bytes": torch.zeros(2, 3, 8, dtype=torch.uint8),
        "features": torch.zeros(2, 3, 8, 16, dtype=torch.int8),
        "scales": torch.ones(2, 3, 8),
    }
    base.update(tensors)
    return save(
        {k: v for k, v in base.items() if v.numel() or v.dim()}, {"format": "blocktrain-relay-1"}
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (_body(scales=torch.full((2, 3, 8), float("nan"))), "non_finite"),
        (_body(features=torch.zeros(2, 3, 8, 16)), "bad_dtype"),
        (_body(bytes=torch.zeros(2, 3, 9, dtype=torch.uint8)), "bad_shape"),
        (_body(features=torch.zeros(2, 3, 8, 12, dtype=torch.int8)), "bad_shape"),
        (_body(extra=torch.zeros(1)), "malformed"),
        (save({"x": torch.zeros(1)}, {"format": "other"}), "malformed"),
        (b"\x80\x04K\x01.", "pickle"),
    ],
)
def test_check_refuses_what_is_not_a_stream_of_the_run(body: bytes, reason: str) -> None:
    with pytest.raises(WireError) as err:
        check(body, Shape(3, 8, 16))
    assert err.value.reason == reason, err.value.detail


def test_check_refuses_an_oversized_body() -> None:
    body = written(steps(2))
    with pytest.raises(WireError) as err:
        check(body, SHAPE, max_bytes=len(body) - 1)
    assert err.value.reason == "too_large"


@pytest.mark.parametrize("bits", [4, 2])
def test_a_packed_stream_reads_back_its_levels_at_a_fraction_of_the_bytes(bits) -> None:
    """relay_bits 4 and 2: each rotated value one of 2^bits levels on the token's RMS, 8 / bits
    a byte; the reader gives back exactly what was sent, and the body is that much smaller."""
    shape = Shape(3, 8, 16, bits)
    writer = StreamWriter(shape)
    batches = steps(2)
    for x, u in batches:
        writer.add(x, u)
    body = writer.finish({"block": "0"}).read()
    stream = RelayStream.from_body(body, shape)
    half = 1 << (bits - 1)
    for i, (want_x, want_u) in enumerate(batches):
        x, u = stream.step(i)
        assert torch.equal(x, want_x)
        assert torch.equal(u, dequantise(*quantise(want_u, bits), bits, 16))
        # in the rotated basis each value inside the levels' range is off by at most half a step
        v, got = rotate(want_u), rotate(u)
        step = STEP[bits] * v.pow(2).mean(-1, keepdim=True).sqrt()
        inside = v.abs() <= half * step
        assert bool(((got - v).abs() <= step / 2 + 1e-4)[inside].all())
    assert len(body) - bytes_per_step(3, 8, 16, bits) * 2 < 512
    assert bytes_per_step(3, 8, 16, bits) == 3 * 8 * (16 * bits // 8 + 5)
    with pytest.raises(WireError, match="this run relays"):
        check(body, SHAPE)  # an 8-bit run refuses a packed stream
    tensors = load(body)
    assert tensors["features"].dtype == torch.uint8


@pytest.mark.parametrize("d", [256, 24, 6])
def test_the_rotation_is_orthonormal_and_undone(d) -> None:
    """Signs then Walsh-Hadamard over chunks of d's largest power-of-two factor (256, 8, 2)."""
    u = torch.randn(5, d, dtype=torch.float64)
    v = rotate(u)
    assert torch.allclose(v.norm(dim=-1), u.norm(dim=-1))
    assert torch.allclose(unrotate(v), u)


def test_the_rotation_spreads_an_outlier_feature_so_few_bits_keep_the_token() -> None:
    """Residual streams carry a few large features; absmax levels spend their range on them and
    round the rest to 0. The rotated codec's error stays near a Gaussian's at either width."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(512, 256, generator=gen)
    u[:, 3] *= 20  # an outlier feature, as trained streams have
    for bits, bound in ((2, 0.40), (4, 0.12)):
        err = (dequantise(*quantise(u, bits), bits, 256) - u).norm() / u.norm()
        top = (1 << (bits - 1)) - 1
        scale = u.abs().amax(-1, keepdim=True) / top
        absmax_err = ((u / scale).round().clamp(-top, top) * scale - u).norm() / u.norm()
        assert err < bound < absmax_err, (bits, float(err), float(absmax_err))


def test_an_8_bit_stream_of_the_first_format_still_reads_and_its_packed_ones_do_not() -> None:
    """blocktrain-relay-1 wrote the same 8-bit codes; its packed codes meant other levels."""
    body = written(steps(1))
    n = int.from_bytes(body[:8], "little")
    old = body[8 : 8 + n].replace(b"blocktrain-relay-2", b"blocktrain-relay-1")
    assert check(body[:8] + old + body[8 + n :], SHAPE).steps == 1
    header = old.decode().replace('"format"', '"bits":"4","d_model":"16","format"', 1).encode()
    header += b" " * (-len(header) % 8)
    with pytest.raises(WireError, match="relay-1 stream's features take 8 bits"):
        check(len(header).to_bytes(8, "little") + header + body[8 + n :])


def test_check_refuses_a_packed_stream_without_its_width_or_with_unknown_bits() -> None:
    body = written(steps(1))
    n = int.from_bytes(body[:8], "little")
    header = body[8 : 8 + n].decode()
    for meta, reason in (('"bits":"4"', "malformed"), ('"bits":"3","d_model":"16"', "malformed")):
        bad = header.replace('"format"', meta + ',"format"', 1).encode()
        bad += b" " * (-len(bad) % 8)
        with pytest.raises(WireError) as err:
            check(len(bad).to_bytes(8, "little") + bad + body[8 + n :])
        assert err.value.reason == reason


def test_relay_bits_and_every_price_a_rounds_stream_and_bad_values_are_refused() -> None:
    """costs.round_bytes: a round's stream holds ceil(H / relay_every) steps of
    bytes_per_step(..., relay_bits); the config refuses other bits and a period below 1."""
    from blocktrain.config import apply_overrides
    from blocktrain.errors import ConfigError
    from blocktrain.presets import preset
    from blocktrain.training.costs import round_bytes

    cfg = apply_overrides(preset("tiny"), ["route=relay", "relay_bits=4", "relay_every=3"])
    m, t = cfg.model, cfg.train
    rounds = round_bytes(cfg, local_steps=10, wire_dtype="fp16")
    want = 4 * bytes_per_step(t.batch_size, m.seq_len, m.d_model, 4)  # ceil(10 / 3) steps
    assert rounds[0]["stream_out"] == want and rounds[1]["stream_in"] == want
    assert rounds[0]["stream_in"] == 0 and rounds[-1]["stream_out"] == 0
    for bad in ("relay_bits=3", "relay_every=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            apply_overrides(preset("tiny"), [bad])
