"""Each validator's verdict and reason, and the chain's order."""

from __future__ import annotations

import pytest
import torch

from blocktrain.protocol.core.bodies import decode, encode
from blocktrain.protocol.core.validation import (
    DEFAULT_CHAIN,
    BlockSpec,
    Candidate,
    Limits,
    check_metadata,
    validate,
)
from blocktrain.protocol.core.verdict import REASONS, Verdict

SPEC = BlockSpec({"w": (3, 2), "b": (3,)}, "fp16")
LIMITS = Limits(max_delta_norm=5.0, max_tokens=1000)


def good() -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), 0.1), "b": torch.zeros(3)}


def meta(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {"block": 1, "base_version": 0, "round": 0, "tokens": 10}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def judge(tensors=None, metadata=None, dtype="fp16") -> tuple[Verdict, Candidate]:
    body = encode(
        good() if tensors is None else tensors, meta() if metadata is None else metadata, dtype
    )
    c = Candidate(1, decode(body), SPEC, LIMITS)
    return validate(c), c


def test_a_good_update_passes_and_is_measured():
    verdict, c = judge()
    assert verdict.accepted, verdict
    assert c.meta is not None and c.meta.tokens == 10 and c.meta.round == 0
    assert c.norm == pytest.approx(float(torch.tensor(0.1, dtype=torch.float16)) * 6**0.5, rel=1e-4)
    assert set(c.tensors) == {"w", "b"}


@pytest.mark.parametrize(
    ("tensors", "metadata", "dtype", "reason"),
    [
        (None, meta(block=None), "fp16", "bad_metadata"),
        (None, meta(round="soon"), "fp16", "bad_metadata"),
        (None, meta(block=2), "fp16", "bad_metadata"),
        (None, meta(base_version=-1), "fp16", "bad_metadata"),
        (None, meta(tokens=0), "fp16", "bad_tokens"),
        (None, meta(tokens=-5), "fp16", "bad_tokens"),
        (None, meta(tokens=10**12), "fp16", "bad_tokens"),
        ({"w": torch.zeros(3, 2)}, None, "fp16", "missing_tensors"),
        ({**good(), "extra": torch.zeros(1)}, None, "fp16", "extra_tensors"),
        ({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, None, "fp16", "bad_shape"),
        (None, None, "fp32", "bad_dtype"),
        (None, None, "bf16", "bad_dtype"),
        (
            {"w": torch.tensor([[0.0, float("nan")]] * 3), "b": torch.zeros(3)},
            None,
            "fp16",
            "non_finite",
        ),
        (
            {"w": torch.zeros(3, 2), "b": torch.tensor([0.0, float("inf"), 0.0])},
            None,
            "fp16",
            "non_finite",
        ),
        ({"w": torch.full((3, 2), 3.0), "b": torch.zeros(3)}, None, "fp16", "norm_too_large"),
    ],
)
def test_each_refusal_has_its_reason(tensors, metadata, dtype, reason):
    verdict, _ = judge(tensors, metadata, dtype)
    assert not verdict.accepted and verdict.reason == reason, verdict
    assert verdict.detail, "a refusal says what was wrong"
    assert 400 <= REASONS[verdict.reason][0] < 500


def test_integer_tensors_are_a_dtype_refusal():
    from safetensors.torch import save

    body = save(
        {"w": torch.zeros(3, 2, dtype=torch.int64), "b": torch.zeros(3)},
        metadata={k: str(v) for k, v in meta().items()},
    )
    verdict = validate(Candidate(1, decode(body), SPEC, LIMITS))
    assert verdict.reason == "bad_dtype", verdict


def test_the_first_refusal_wins():
    # wrong tokens and NaN: the token check comes first
    verdict, _ = judge({"w": torch.full((3, 2), float("nan")), "b": torch.zeros(3)}, meta(tokens=0))
    assert verdict.reason == "bad_tokens"
    calls = []

    def spy(c: Candidate) -> Verdict:
        calls.append("spy")
        return Verdict.ok()

    body = encode(good(), meta(block=9))
    verdict = validate(Candidate(1, decode(body), SPEC, LIMITS), (check_metadata, spy))
    assert verdict.reason == "bad_metadata" and calls == [], "later validators do not run"


def test_verdict_refuses_unknown_reasons():
    with pytest.raises(ValueError):
        Verdict.refuse("because")
    assert Verdict.ok().status == 200 and Verdict.refuse("late").status == 409
    assert len(DEFAULT_CHAIN) == 9
