"""UTF-8 constrained decoding (model/utf8.py, Sampling(utf8=True)): the automaton agrees with
Python's strict decoder, and every way bytes are drawn (a span's K positions, the
autoregressive reference, speculative verification) keeps the text valid
with it, where the same seed without it does not."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from blocktrain.config import ModelConfig
from blocktrain.model import (
    BlockStack,
    Sampling,
    SigmaSchedule,
    generate,
    generate_autoregressive,
    init_reference,
    sample_bytes,
    stack_denoiser,
    utf8,
)
from blocktrain.model.speculative import generate_speculative
from tests.model.test_sampler import lively_stack

CFG = ModelConfig(d_model=32, n_heads=2, layers=3, blocks=3, seq_len=16, span=4)
PROMPT = "Zoë says ".encode()


def valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def automaton_valid(data: bytes) -> bool:
    """Whether the automaton takes every byte and ends at a boundary."""
    state = utf8.ACCEPT
    for b in data:
        state = int(utf8.NEXT[state, b])
        if state < 0:
            return False
    return state == utf8.ACCEPT


def test_the_automaton_is_pythons_strict_utf8_on_every_short_sequence():
    candidates = [bytes([a]) for a in range(256)]
    candidates += [bytes([a, b]) for a in range(256) for b in range(256)]
    tails = [*range(0x70, 0xC8), 0x00, 0x41, 0xFF]
    candidates += [bytes([a, b, c]) for a in range(0xE0, 0xF0) for b in tails for c in tails]
    probes = [0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0]
    candidates += [
        bytes([a, b, c, d])
        for a in range(0xF0, 0xF8)
        for b, c, d in itertools.product(probes, repeat=3)
    ]
    table = utf8.NEXT.tolist()

    def fast(data: bytes) -> bool:
        state = 0
        for b in data:
            state = table[state][b]
            if state < 0:
                return False
        return state == 0

    wrong = [c for c in candidates if fast(c) != valid(c)]
    assert not wrong, wrong[:5]
    assert automaton_valid("a€𝄞é".encode()) and not automaton_valid(b"\xed\xa0\x80")  # surrogate


def test_the_state_after_a_text_comes_from_its_last_three_bytes():
    rng = random.Random(0)
    text = "".join(rng.choice("aé€𝄞") for _ in range(200)).encode()
    for cut in range(1, len(text)):
        head = text[:cut]
        complete = utf8.complete_length(head)
        expected_open = cut != complete
        assert (utf8.state_after(head) != utf8.ACCEPT) == expected_open
        assert valid(head[:complete]) and len(head) - complete <= 3
    assert utf8.state_after(b"x\xe2\x82") == 1 and utf8.state_after(b"\xf0") == 6


def test_after_a_lead_byte_only_its_continuations_may_come():
    allowed = utf8.ALLOWED[utf8.state_after("€".encode()[:2])]
    assert allowed.nonzero().flatten().tolist() == list(range(0x80, 0xC0))
    after_e0 = utf8.ALLOWED[utf8.state_after(b"\xe0")].nonzero().flatten().tolist()
    assert after_e0 == list(range(0xA0, 0xC0)), "no overlong 3-byte forms"
    assert not utf8.ALLOWED[utf8.ACCEPT, 0x80:0xC2].any(), "no stray continuation, no C0/C1"


def adversarial_logits(rows: int, k: int, seed: int) -> torch.Tensor:
    """Logits that favour bytes 0x80..0xFF: drawn freely, the text is invalid almost surely."""
    logits = torch.randn(rows, k, 256, generator=torch.Generator().manual_seed(seed))
    logits[..., 0x80:] += 3.0
    return logits


@pytest.mark.parametrize(
    "sampling",
    [Sampling(), Sampling(temperature=0), Sampling(top_k=3), Sampling(top_p=0.5, temperature=2)],
    ids=["t1", "greedy", "top_k", "top_p"],
)
def test_sampled_spans_are_valid_utf8_with_the_constraint_and_not_without(sampling):
    logits = adversarial_logits(8, 12, seed=3)
    free = sample_bytes(logits, sampling, torch.Generator().manual_seed(0))
    kept = sample_bytes(
        logits, dataclasses.replace(sampling, utf8=True), torch.Generator().manual_seed(0)
    )
    assert not all(valid(bytes(row.tolist())) for row in free), "the test could not fail"
    for row in kept:
        data = bytes(row.tolist())
        assert valid(data[: utf8.complete_length(data)]) and utf8.complete_length(data) >= 8


def test_the_constraint_continues_the_character_the_prefix_left_open():
    prefix = torch.tensor([list(b"ab\xe2\x82"), list(b"abcd")])
    logits = torch.zeros(2, 1, 256)
    logits[..., 0x41] = 50.0  # "A" is by far the likeliest
    out = sample_bytes(logits, Sampling(utf8=True), torch.Generator().manual_seed(0), prefix)
    assert 0x80 <= int(out[0, 0]) < 0xC0, "a continuation byte completes the open character"
    assert int(out[1, 0]) == 0x41


def _generate(stack: BlockStack, sampling: Sampling, seed: int, method: str = "euler") -> bytes:
    cfg = stack.cfg
    out = generate(
        stack_denoiser(stack),
        torch.tensor([list(PROMPT)]),
        40,
        grid=SigmaSchedule.from_config(cfg).sampler_grid(2),
        targets=stack.targets,
        span=cfg.span,
        max_context=cfg.seq_len - cfg.span,
        sampling=sampling,
        generator=torch.Generator().manual_seed(seed),
        method=method,
    )
    return bytes(out[0].tolist())


@torch.no_grad()
@pytest.mark.parametrize("method", ["euler", "ancestral"])
def test_an_untrained_stack_writes_valid_utf8_only_with_the_constraint(method):
    cfg = dataclasses.replace(CFG, blocks=3, layers=3)
    stack = lively_stack(cfg)
    free = [_generate(stack, Sampling(), seed, method) for seed in range(3)]
    assert not all(valid(d) for d in free), "the untrained stack writes invalid bytes"
    for seed in range(3):
        data = _generate(stack, Sampling(utf8=True), seed, method)
        assert len(data) == 40
        assert valid((PROMPT + data)[: len(PROMPT) + utf8.complete_length(data)])
        assert utf8.complete_length(data) >= 37


@torch.no_grad()
def test_the_reference_writes_valid_utf8_with_the_constraint():
    cfg = dataclasses.replace(CFG, span=1)
    ref = init_reference(cfg, seed=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if not p.any():
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))

    def run(sampling: Sampling) -> bytes:
        prompt = torch.tensor([list(PROMPT)])
        gen = torch.Generator().manual_seed(4)
        return bytes(
            generate_autoregressive(
                ref, prompt, 30, seq_len=ref.cfg.seq_len, sampling=sampling, generator=gen
            )[0]
        )

    assert not valid(run(Sampling()))
    data = run(Sampling(utf8=True))
    assert valid(data[: utf8.complete_length(data)]) and utf8.complete_length(data) >= 27


class HighByteDrafter:
    """Drafts bytes 0x80..0xFF uniformly: alone, they are never valid UTF-8."""

    def draft(self, context, n, generator):
        laws = torch.zeros(n, 256, dtype=torch.float64)
        laws[:, 0x80:] = 1 / 128
        drafted = (
            [int(b) for b in torch.multinomial(laws[0], n, True, generator=generator)] if n else []
        )
        return drafted, laws


@torch.no_grad()
def test_speculative_verification_keeps_to_utf8_whatever_is_drafted():
    cfg = dataclasses.replace(CFG, span=1)
    stack = lively_stack(cfg)

    def run(sampling: Sampling) -> bytes:
        out, _ = generate_speculative(
            stack_denoiser(stack),
            torch.tensor([list(PROMPT)]),
            30,
            drafter=HighByteDrafter(),
            draft_len=4,
            grid=SigmaSchedule.from_config(cfg).sampler_grid(1),
            targets=stack.targets,
            seq_len=cfg.seq_len,
            sampling=sampling,
            generator=torch.Generator().manual_seed(5),
            draws=2,
        )
        return bytes(out[0].tolist())

    assert not valid(run(Sampling()))
    data = run(Sampling(utf8=True))
    assert valid(data[: utf8.complete_length(data)]) and utf8.complete_length(data) >= 27
