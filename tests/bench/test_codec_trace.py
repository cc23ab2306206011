"""bench/codec_trace.py: what a push codec sent and kept, per tensor kind and push."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import codec_trace
from blocktrain.protocol.core.codecs import DeltaEncoder


def delta(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(257, 64, generator=gen),
        "layers.0.modulation.weight": torch.randn(384, 32, generator=gen),
        "layers.0.fc1.weight": torch.randn(256, 64, generator=gen),
        "layers.0.ln1.bias": torch.randn(64, generator=gen),
        "out_proj.weight": torch.randn(64, 64, generator=gen),
    }


def test_kinds_follow_the_block_parameter_names() -> None:
    assert codec_trace.kind_of("embed.weight") == "embeddings"
    assert codec_trace.kind_of("layers.3.modulation.bias") == "noise conditioning"
    assert codec_trace.kind_of("layers.0.proj.weight") == "attention"
    assert codec_trace.kind_of("out_proj.weight") == "heads"  # not attention's .proj.
    assert codec_trace.kind_of("aux_head.bias") == "heads"
    assert codec_trace.kind_of("layers.1.fc2.weight") == "mlp"
    assert codec_trace.kind_of("something.new") == "other"


def test_a_sparse_push_sends_a_share_and_keeps_the_rest_dense_sends_all() -> None:
    original = DeltaEncoder.compress
    sparse, dense = DeltaEncoder("sparse:0.03:2"), DeltaEncoder("fp16")
    with codec_trace.traced() as trace:
        for seed in (0, 1):
            sparse.compress(delta(seed))
        dense.compress(delta(2))
    assert DeltaEncoder.compress is original  # restored after the run
    out = trace.summary()
    assert set(out) == {"embeddings", "noise conditioning", "mlp", "norms", "heads"}
    first, second = out["mlp"][0], out["mlp"][1]
    assert first[0] == 1 and second[0] == 2
    # push 1 pools the sparse worker's first push with the dense one's (|sent|^2 summed)
    assert 0.5 < first[1] < 1.0 and first[2] > 0
    assert 0 < second[1] < 0.5  # the sparse worker's second push alone: a few % of the values
    assert second[2] > first[2]  # the residual grows while most of each delta waits

    lone = codec_trace.Trace()
    d = delta(3)
    lone.record(dense, d, d, None)
    assert lone.summary()["mlp"] == [[1, pytest.approx(1.0), 0.0]]


def test_the_table_shows_lossy_rows_at_their_first_middle_and_last_push() -> None:
    dense = {"wire": "fp16", "rounds": 3, "local_steps": 3, "seed": 0}
    dense["codec_trace"] = {"mlp": [[1, 1.0, 0.0], [2, 1.0, 0.0]]}
    sparse = {**dense, "wire": "sparse:0.03:2", "preset": "small", "route": "relay"}
    sparse["codec_trace"] = {"mlp": [[1, 0.04, 0.98], [2, 0.05, 1.3], [3, 0.06, 1.7]]}
    text = codec_trace.markdown([dense, sparse])
    row = "| small | relay | 3 x 3 | 0 | sparse:0.03:2 | mlp | 0.040 / 0.050 / 0.060 | "
    assert row + "0.98 / 1.30 / 1.70 |" in text
    assert "fp16" not in text.split("|---|")[-1]  # a dense codec sends everything: no row
    assert codec_trace.markdown([dense]) == ""
