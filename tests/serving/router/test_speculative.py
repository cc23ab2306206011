"""Speculative generation through the chain: drafted on the router, verified in one traversal
of the K = 1 model's hosts, and the same bytes as the in-process loop."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from blocktrain.data.ngram import NgramDrafter
from blocktrain.model import BlockStack, Sampling, SigmaSchedule, stack_denoiser
from blocktrain.model.speculative import (
    Drafter,
    ModelDrafter,
    SpeculativeLoop,
    generate_autoregressive_speculative,
    generate_speculative,
)
from blocktrain.training import load_model
from tests.conftest import TEXT

DRAFTER = NgramDrafter(np.frombuffer((TEXT * 10).encode(), dtype=np.uint8), order=3)


@pytest.fixture(scope="module")
def k1(runs) -> BlockStack:
    _, model = load_model(runs.next_byte)
    assert isinstance(model, BlockStack) and model.cfg.span == 1
    return model


def in_process_speculative(
    k1: BlockStack, prompt: bytes, drafter: Drafter, steps: int, sampler: str, draws: int
) -> tuple[torch.Tensor, SpeculativeLoop]:
    """What the in-process speculative loop writes for 12 bytes, 4 drafted, seed 4."""
    return generate_speculative(
        stack_denoiser(k1),
        torch.tensor([list(prompt)]),
        12,
        drafter=drafter,
        draft_len=4,
        grid=SigmaSchedule.from_config(k1.cfg).sampler_grid(steps),
        targets=k1.targets,
        seq_len=k1.cfg.seq_len,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(4),
        method=sampler,
        draws=draws,
    )


@pytest.mark.parametrize(
    ("sampler", "steps", "verify_draws", "drafter"),
    [
        ("euler", 2, 1, "ngram"),
        ("ancestral", 2, 3, "ngram"),  # the draws fork inside the last host
        ("ancestral", 1, 3, "ngram"),  # the host before the last forks them: copies travel
        ("euler", 2, 4, "model"),
    ],
)
def test_verified_drafts_through_the_chain_are_the_in_process_loops_bytes(
    cluster, runs, k1, sampler, steps, verify_draws, drafter
):
    prompt = b"Valkyria Chronicles is a "
    request = {"model": "bt1", "prompt": prompt.decode(), "max_bytes": 12, "seed": 4}
    extra = {
        "draft_bytes": 4,
        "sampler": sampler,
        "steps_per_block": steps,
        "verify_draws": verify_draws,
    }
    drafts = DRAFTER if drafter == "ngram" else ModelDrafter(load_model(runs.reference)[1])
    with cluster.router(drafter=drafts) as router:
        r = router.post("/v1/generate", json={**request, **extra})
    assert r.status_code == 200, r.text
    expected, loop = in_process_speculative(k1, prompt, drafts, steps, sampler, verify_draws)
    # The hosts run the in-process loop's code on the same shapes: the same bytes exactly.
    assert r.json()["bytes"] == expected[0].tolist()
    assert r.json()["traversals"] == loop.traversals <= 12
    assert loop.drafted > 0


def test_the_autoregressive_pipeline_verifies_the_same_drafts_with_its_caches(cluster, runs):
    _, ref = load_model(runs.reference)
    prompt = b"Valkyria Chronicles is a "
    request = {"model": "ref", "prompt": prompt.decode(), "max_bytes": 20, "seed": 3}
    with cluster.router(drafter=DRAFTER) as router:
        r = router.post("/v1/generate", json={**request, "draft_bytes": 4})
    assert r.status_code == 200, r.text
    expected, loop = generate_autoregressive_speculative(
        ref,
        torch.tensor([list(prompt)]),
        20,
        drafter=DRAFTER,
        draft_len=4,
        seq_len=ref.cfg.seq_len,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(3),
    )
    # The pipeline scores with KV caches, the in-process loop with a full forward: logits
    # equal to ~1e-6, so an acceptance draw would have to fall within that of its threshold to
    # decide otherwise; 20 bytes run past T = 16, so caches are cut back and restarted.
    assert r.json()["bytes"] == expected[0].tolist()
    assert r.json()["traversals"] == loop.traversals < 20
    for url in cluster.urls:
        sessions = cluster.apps.apps[url].state.host.sessions
        assert len(sessions) == 0, "one session per generation, closed by its last step"


def test_streamed_completions_carry_the_verified_bytes(cluster):
    request = {"model": "bt1", "prompt": "Sega ", "max_tokens": 10, "seed": 2, "draft_bytes": 3}
    with cluster.router(drafter=DRAFTER) as router:
        plain = router.post("/v1/completions", json=request).json()["choices"][0]["text"]
        r = router.post("/v1/completions", json={**request, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(chunks) == plain and len(plain.encode("utf-8", "surrogateescape")) >= 1
    assert len(chunks) - 1 < 10, "several bytes per traversal come as one chunk"


def test_drafting_is_refused_where_it_cannot_be_exact(cluster):
    request = {"prompt": "The ", "max_bytes": 4, "draft_bytes": 3}
    with cluster.router(drafter=DRAFTER) as router:
        span2 = router.post("/v1/generate", json={**request, "model": "bt"})
        too_many = router.post("/v1/generate", json={**request, "model": "bt1", "draft_bytes": 15})
        draws = [
            router.post("/v1/generate", json={**request, "model": "bt1", "verify_draws": m})
            for m in (0, 17)
        ]
    assert span2.status_code == 400 and "has K = 2" in span2.json()["error"]["message"]
    assert too_many.status_code == 400 and "exceeds the limit of 14" in too_many.text
    for r in draws:
        assert r.status_code == 400 and r.json()["error"]["param"] == "verify_draws", r.text
    with cluster.router() as router:
        r = router.post("/v1/generate", json={**request, "model": "bt1"})
    assert r.status_code == 400 and "has no drafter" in r.json()["error"]["message"]


def test_the_routers_default_draft_applies_where_drafting_can_be_exact(cluster):
    """`serve --draft-bytes`: requests that leave draft_bytes out draft that many, unless the
    model has K > 1 or the request asks for logprobs; 0 opts out."""
    request = {"model": "bt1", "prompt": "Valkyria Chronicles is a ", "max_bytes": 12, "seed": 4}
    with cluster.router(drafter=DRAFTER, draft_bytes=4) as router:
        default = router.post("/v1/generate", json=request).json()
        asked = router.post("/v1/generate", json={**request, "draft_bytes": 4}).json()
        off = router.post("/v1/generate", json={**request, "draft_bytes": 0}).json()
        span2 = router.post("/v1/generate", json={**request, "model": "bt"})
        # utf8 off: a character the budget cuts would be dropped, leaving fewer than 6 bytes
        completion = {
            "model": "bt1",
            "prompt": "Sega ",
            "max_tokens": 6,
            "logprobs": 1,
            "utf8": False,
        }
        logprobs = router.post("/v1/completions", json=completion)
        refused = router.post("/v1/completions", json={**completion, "draft_bytes": 3})
        ar = {**request, "model": "ref", "max_bytes": 20}
        ar_default = router.post("/v1/generate", json=ar).json()
        ar_asked = router.post("/v1/generate", json={**ar, "draft_bytes": 4}).json()
        greedy = {**ar, "temperature": 0}
        greedy_drafted = router.post("/v1/generate", json=greedy).json()
        greedy_plain = router.post("/v1/generate", json={**greedy, "draft_bytes": 0}).json()
    assert (default["bytes"], default["traversals"]) == (asked["bytes"], asked["traversals"])
    assert default["traversals"] < 12 and off["traversals"] == 12
    assert span2.status_code == 200 and span2.json()["traversals"] == 6  # K = 2: not drafted
    assert logprobs.status_code == 200, logprobs.text
    assert len(logprobs.json()["choices"][0]["logprobs"]["token_logprobs"]) == 6
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert (ar_default["bytes"], ar_default["traversals"]) == (
        ar_asked["bytes"],
        ar_asked["traversals"],
    )
    assert ar_default["traversals"] < 20
    # Greedy autoregressive text is one string however it is drafted.
    assert greedy_drafted["bytes"] == greedy_plain["bytes"]
