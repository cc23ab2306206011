"""Block hosts serving a `route = features` run: each host passes its last block's clean output
(`u`, the whole context's) on with z, the next host's block reads it, and the chain gives the
bytes the in-process sampler gives, with and without the clean-stream caches, batched or not,
one block per host or several."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.model import BlockStack, SigmaSchedule, ZLayout, stack_denoiser
from blocktrain.model.sampler import run_points
from blocktrain.serving import HostSettings, ModelSource, create_host_app
from blocktrain.serving.host.block_host import BlockHost
from blocktrain.serving.shared.wire import CONTENT_TYPE, SweepHeader, decode, encode
from blocktrain.training import load_model
from tests.serving.conftest import Runs, generate_together, in_process, start_cluster
from tests.serving.router.test_speculative import DRAFTER, in_process_speculative

TOL = {"rtol": 1e-4, "atol": 1e-5}


def features_models(runs: Runs) -> tuple[ModelSource, ...]:
    return (ModelSource("btf", runs.features), ModelSource("btf1", runs.features_next_byte))


@pytest.fixture(scope="module")
def stack(runs: Runs) -> BlockStack:
    _, model = load_model(runs.features)
    assert isinstance(model, BlockStack) and model.cfg.route == "features"
    return model


def host(runs: Runs, parts: tuple[int, ...]) -> BlockHost:
    app = create_host_app(
        HostSettings(models=features_models(runs), parts=parts, public_url="http://h:8100")
    )
    assert isinstance(app.state.host, BlockHost)
    return app.state.host


def sweep_body(h: BlockHost, x: torch.Tensor, step: int, **tensors: torch.Tensor) -> bytes:
    model = h.models["btf"]
    cfg = model.config.model
    z = 5 * torch.randn(
        x.shape[0], cfg.span, cfg.d_model, generator=torch.Generator().manual_seed(1)
    )
    head = SweepHeader(model="btf", fingerprint=model.fingerprint, step=step)
    return encode({"x": x.to(torch.uint8), "z": z, **tensors}, head.model_dump())


@pytest.mark.parametrize(
    ("parts", "kv_cache", "sampler"),
    [
        ([(0,), (1,), (2,)], True, "euler"),
        ([(0,), (1,), (2,)], False, "ancestral"),
        ([(0, 1), (2,)], True, "ancestral"),  # block 0 feeds block 1 on the same host
        ([(0,), (1, 2)], True, "euler"),
    ],
)
def test_a_chain_of_hosts_passes_the_features_and_gives_generate_s_bytes(
    runs, stack, parts, kv_cache, sampler
):
    cluster = start_cluster(runs, parts, models=features_models(runs), kv_cache=kv_cache)
    request = {
        "model": "btf",
        "prompt": "Sega ",
        "max_bytes": 8,
        "seed": 5,
        "sampler": sampler,
        "steps_per_block": 2,
    }
    with cluster.router() as router:
        r = router.post("/v1/generate", json=request)
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == in_process(
        stack, b"Sega ", 8, 5, steps_per_block=2, sampler=sampler
    )


def test_the_chain_s_logits_are_the_in_process_sweep_s_from_the_first_sweep_and_the_cache(
    runs, stack
):
    """Logits, not only bytes: a sampled byte hides small errors, a logit does not."""
    hosts = [host(runs, (0,)), host(runs, (1,)), host(runs, (2,))]
    cfg = stack.cfg
    grid = SigmaSchedule.from_config(cfg).sampler_grid(1)
    x = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    for length in (7, 9, 11):  # the later sweeps take the earlier positions from the caches
        if length == 11:  # block 1's host is replaced: its replica holds no cache, and reads
            hosts[1] = host(runs, (1,))  # the whole context's features from block 0's cache
        context = x[:, :length]
        z = 5 * torch.randn(
            2, cfg.span, cfg.d_model, generator=torch.Generator().manual_seed(length)
        )
        head = SweepHeader(
            model="btf", fingerprint=hosts[0].models["btf"].fingerprint, step=0, session="g"
        )
        message = encode({"x": context.to(torch.uint8), "z": z}, head.model_dump())
        for h in hosts:
            message, _ = asyncio.run(h.sweep(message))
        got = decode(message)[0]["logits"]
        _, want = run_points(
            stack_denoiser(stack),
            context,
            z,
            grid,
            stack.targets,
            ZLayout.next_span(length, cfg.span),
        )
        torch.testing.assert_close(got, want, **TOL)
    assert hosts[0].info()["kv_cache"]["positions_reused"] == 2 * (7 + 9)


def test_a_host_passes_its_block_s_clean_output_over_the_whole_context(runs, stack):
    first, last = host(runs, (0,)), host(runs, (1, 2))
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    answer, _ = asyncio.run(first.sweep(sweep_body(first, x, 0)))
    passed, _ = decode(answer)
    assert passed["u"].shape == (2, 9, stack.cfg.d_model)
    upstream = stack.upstream(1, x)
    assert upstream is not None
    torch.testing.assert_close(passed["u"], upstream, **TOL)
    final, _ = asyncio.run(last.sweep(answer))
    assert set(decode(final)[0]) == {"logits"}, "the last block's output goes nowhere"


def test_a_sweep_past_block_0_without_the_features_is_refused(runs):
    app = create_host_app(
        HostSettings(models=features_models(runs), parts=(1, 2), public_url="http://h:8100")
    )
    h = app.state.host
    x = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    grid_step = len(h.models["btf"].grid(1)) // 3  # block 1's first point
    bad = {
        "missing": {},
        "wrong shape": {"u": torch.zeros(1, 5, 32)},
        "non-finite": {"u": torch.full((1, 6, 32), float("nan"))},
    }
    with TestClient(app) as client:
        for why, tensors in bad.items():
            r = client.post(
                "/v1/sweep",
                content=sweep_body(h, x, grid_step, **tensors),
                headers={"content-type": CONTENT_TYPE},
            )
            assert r.status_code == 400, why
            assert r.json()["error"]["param"] == "u", why


def test_batched_generations_of_different_lengths_read_their_own_features(runs, stack):
    cluster = start_cluster(runs, models=features_models(runs), batch_window_ms=30.0)
    prompts = [b"Sega ", b"The game ", b"A"]
    bodies = [
        {"model": "btf", "prompt": p.decode(), "max_bytes": 6, "seed": 10 + i}
        for i, p in enumerate(prompts)
    ]
    answers, _ = generate_together(cluster, bodies)
    hosts = [cluster.apps.apps[u].state.host for u in cluster.urls]  # type: ignore[attr-defined]
    assert max(h.batcher.stats.largest for h in hosts) > 1, "no sweeps shared a pass"
    for p, i, r in zip(prompts, range(3), answers, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["bytes"] == in_process(stack, p, 6, 10 + i)


def test_verify_sweeps_of_a_features_run_give_the_in_process_loops_bytes(runs):
    _, k1 = load_model(runs.features_next_byte)
    assert isinstance(k1, BlockStack) and k1.cfg.span == 1
    cluster = start_cluster(runs, models=features_models(runs))
    prompt = b"Valkyria Chronicles is a "
    request = {"model": "btf1", "prompt": prompt.decode(), "max_bytes": 12, "seed": 4}
    extra = {"draft_bytes": 4, "sampler": "ancestral", "steps_per_block": 1, "verify_draws": 3}
    with cluster.router(drafter=DRAFTER) as router:
        r = router.post("/v1/generate", json={**request, **extra})
    assert r.status_code == 200, r.text
    expected, loop = in_process_speculative(k1, prompt, DRAFTER, 1, "ancestral", 3)
    assert loop.drafted > 0
    assert r.json()["bytes"] == expected[0].tolist()
