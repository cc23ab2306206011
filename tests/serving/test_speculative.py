"""Speculative generation through the chain: drafted on the router, verified in one traversal
of the K = 1 model's hosts, and the same bytes as the in-process loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktrain.data.ngram import NgramDrafter
from blocktrain.model import BlockStack, Sampling, SigmaSchedule, stack_denoiser
from blocktrain.model.speculative import generate_speculative
from blocktrain.training import load_model
from tests.conftest import TEXT

DRAFTER = NgramDrafter(np.frombuffer((TEXT * 10).encode(), dtype=np.uint8), order=3)


@pytest.fixture(scope="module")
def k1(runs) -> BlockStack:
    _, model = load_model(runs.next_byte)
    assert isinstance(model, BlockStack) and model.cfg.span == 1
    return model


@pytest.mark.parametrize("sampler", ["euler", "ancestral"])
def test_verified_drafts_through_the_chain_are_the_in_process_loops_bytes(cluster, k1, sampler):
    prompt = b"Valkyria Chronicles is a "
    request = {"model": "bt1", "prompt": prompt.decode(), "max_bytes": 12, "seed": 4}
    extra = {"draft_bytes": 4, "sampler": sampler, "steps_per_block": 2}
    with cluster.router(drafter=DRAFTER) as router:
        r = router.post("/v1/generate", json={**request, **extra})
    assert r.status_code == 200, r.text
    expected, loop = generate_speculative(
        stack_denoiser(k1),
        torch.tensor([list(prompt)]),
        12,
        drafter=DRAFTER,
        draft_len=4,
        grid=SigmaSchedule.from_config(k1.cfg).sampler_grid(2),
        targets=k1.targets,
        seq_len=k1.cfg.seq_len,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(4),
        method=sampler,
    )
    # The hosts run the in-process loop's code on the same shapes: the same bytes exactly.
    assert r.json()["bytes"] == expected[0].tolist()
    assert r.json()["traversals"] == loop.traversals <= 12
    assert loop.drafted > 0


def test_drafting_is_refused_where_it_cannot_be_exact(cluster):
    request = {"prompt": "The ", "max_bytes": 4, "draft_bytes": 3}
    with cluster.router(drafter=DRAFTER) as router:
        span2 = router.post("/v1/generate", json={**request, "model": "bt"})
        ref = router.post("/v1/generate", json={**request, "model": "ref"})
        too_many = router.post("/v1/generate", json={**request, "model": "bt1", "draft_bytes": 15})
    for r in (span2, ref):
        assert r.status_code == 400 and "K = 1 one-sweep model" in r.json()["error"]["message"]
    assert too_many.status_code == 400 and "exceeds the limit of 14" in too_many.text
    with cluster.router() as router:
        r = router.post("/v1/generate", json={**request, "model": "bt1"})
    assert r.status_code == 400 and "has no drafter" in r.json()["error"]["message"]
