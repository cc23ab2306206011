"""Block hosts serving a `route = features` run: each host passes its last block's clean output
(`u`, the whole context's) on with z, the next host's block reads it, and the chain gives the
bytes the in-process sampler gives, with and without the clean-stream caches, batched or not,
one block per host or several."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.data import load_split
from blocktrain.model import (
    BlockStack,
    Sampling,
    SigmaSchedule,
    ZLayout,
    generate_autoregressive,
    head_logits,
    stack_denoiser,
)
from blocktrain.model.sampler import run_points
from blocktrain.model.speculative import generate_autoregressive_speculative
from blocktrain.serving import HostSettings, ModelSource, create_host_app
from blocktrain.serving.host.block_host import BlockHost
from blocktrain.serving.shared.serving_errors import reversed_stack_sweep
from blocktrain.serving.shared.wire import CONTENT_TYPE, StageHeader, SweepHeader, decode, encode
from blocktrain.training import Trainer, load_model
from tests.conftest import micro_config
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
    return sweep_body_for(h, "btf", x, step, **tensors)


def sweep_body_for(
    h: BlockHost, name: str, x: torch.Tensor, step: int = 0, **tensors: torch.Tensor
) -> bytes:
    model = h.models[name]
    cfg = model.config.model
    z = 5 * torch.randn(
        x.shape[0], cfg.span, cfg.d_model, generator=torch.Generator().manual_seed(1)
    )
    head = SweepHeader(model=name, fingerprint=model.fingerprint, step=step)
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


def in_process_head(stack: BlockStack, prompt: bytes, n: int, seed: int) -> list[int]:
    """`blocktrain generate --exit head`'s bytes, in this process."""
    out = generate_autoregressive(
        functools.partial(head_logits, stack),
        torch.tensor([list(prompt)]),
        n,
        seq_len=stack.cfg.seq_len,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(seed),
    )
    return out[0].tolist()


@pytest.mark.parametrize("parts", [[(0,), (1,), (2,)], [(0, 1), (2,)]])
def test_the_head_exit_over_hosts_gives_the_in_process_bytes(runs, stack, parts):
    """exit = head: one traversal per byte through the blocks' clean streams, each host caching
    its blocks' keys and values and passing its last block's output with the bytes; the last
    host draws from the head. The bytes equal `generate --exit head`'s (within one window of
    T = 16: past it the chain restarts its window at T / 2, as the reference's pipeline does)."""
    cluster = start_cluster(runs, parts, models=features_models(runs))
    request = {"model": "btf", "prompt": "Sega ", "max_bytes": 11, "seed": 3, "exit": "head"}
    with cluster.router() as router:
        r = router.post("/v1/generate", json=request)
        assert r.status_code == 200, r.text
        assert r.json()["traversals"] == 11
        refused = router.post("/v1/generate", json={**request, "model": "btf1"} | {"exit": "x"})
        assert refused.status_code == 400
    assert r.json()["bytes"] == in_process_head(stack, b"Sega ", 11, 3)


def test_the_head_exit_is_refused_where_there_is_no_chain_of_features(runs):
    models = (ModelSource("bts", runs.state), ModelSource("ref", runs.reference))
    cluster = start_cluster(runs, models=models)  # a route = state run and the reference
    with cluster.router() as router:
        for model in ("bts", "ref"):
            r = router.post(
                "/v1/generate", json={"model": model, "prompt": "a", "max_bytes": 2, "exit": "head"}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "exit", r.text


def test_the_head_exit_s_logits_over_hosts_are_the_in_process_head_s(runs, stack):
    """Logits, not bytes (a sampled byte of this small model hides a missing upstream): three
    hosts, a prefill and then cached steps, each host's blocks reading the one before."""
    hosts = [host(runs, (0,)), host(runs, (1,)), host(runs, (2,))]
    fingerprint = hosts[0].models["btf"].fingerprint
    x = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    want = head_logits(stack, x)
    for lo, hi in ((0, 7), (7, 9), (9, 11)):
        head = StageHeader(
            model="btf", fingerprint=fingerprint, final="logits", session="g", pos=lo
        )
        message = encode({"x": x[:, lo:hi].to(torch.uint8)}, head.model_dump())
        for h in hosts:
            message, _ = asyncio.run(h.stage(message))
        got = decode(message)[0]["logits"]
        torch.testing.assert_close(got, want[:, hi - 1], **TOL)


def test_a_reversed_stack_is_served_through_its_head_exit_only(runs, tmp_path):
    """intervals = reversed: the sweep would start at the last block, so the router and the
    hosts refuse exit = sampler (400, param exit); exit = head, and the default exit = auto,
    give the in-process head's bytes; /readyz probes it through its head stages."""
    cfg = micro_config(steps=2)
    model = dataclasses.replace(cfg.model, route="features", intervals="reversed")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "wiki.train.raw").write_text("Sega released the game in Japan. " * 40)
    run = tmp_path / "rev"
    train = load_split(corpus, "train")
    Trainer.create(dataclasses.replace(cfg, model=model), run, train, None).run(progress=False)
    _, reversed_stack = load_model(run)
    assert isinstance(reversed_stack, BlockStack)
    cluster = start_cluster(runs, models=(ModelSource("rev", run),))
    request = {"model": "rev", "prompt": "Sega ", "max_bytes": 6, "seed": 2}
    with cluster.router() as router:
        refused = router.post("/v1/generate", json={**request, "exit": "sampler"})
        r = router.post("/v1/generate", json={**request, "exit": "head"})
        auto = router.post("/v1/generate", json=request)
        completion = router.post(
            "/v1/completions",
            json={"model": "rev", "prompt": "Sega ", "max_tokens": 6, "seed": 2, "utf8": False},
        )
        ready = router.get("/readyz")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "exit"
    refusal = reversed_stack_sweep("rev").message  # the one text, in the router and the hosts
    assert refused.json()["error"]["message"] == refusal
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == in_process_head(reversed_stack, b"Sega ", 6, 2)
    assert auto.status_code == 200 and auto.json() | {"timing": None} == r.json() | {"timing": None}
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == auto.json()["text"]
    assert ready.status_code == 200, ready.text
    h = create_host_app(HostSettings(models=(ModelSource("rev", run),), parts=(0, 1, 2)))
    body = sweep_body_for(h.state.host, "rev", torch.tensor([[1, 2, 3, 4]]))
    with TestClient(h) as client:
        answer = client.post("/v1/sweep", content=body, headers={"content-type": CONTENT_TYPE})
    assert answer.status_code == 400 and answer.json()["error"]["message"] == refusal


def test_the_head_exit_verifies_drafts_as_the_reference_pipeline_does(runs):
    """exit = head with drafting: the router drafts, the chain's head stages score the draft's
    positions in one traversal, and the bytes are the in-process speculative loop's over the
    same head (fewer traversals than bytes)."""
    _, k1 = load_model(runs.features_next_byte)
    assert isinstance(k1, BlockStack) and k1.cfg.span == 1
    cluster = start_cluster(runs, models=features_models(runs))
    prompt = b"Valkyria Chronicles is a "
    request = {"model": "btf1", "prompt": prompt.decode(), "max_bytes": 12, "seed": 3}
    with cluster.router(drafter=DRAFTER) as router:
        r = router.post("/v1/generate", json={**request, "exit": "head", "draft_bytes": 4})
    assert r.status_code == 200, r.text
    expected, loop = generate_autoregressive_speculative(
        functools.partial(head_logits, k1),
        torch.tensor([list(prompt)]),
        12,
        drafter=DRAFTER,
        draft_len=4,
        seq_len=k1.cfg.seq_len,
        sampling=Sampling(),
        generator=torch.Generator().manual_seed(3),
    )
    assert r.json()["bytes"] == expected[0].tolist()
    assert r.json()["traversals"] == loop.traversals < 12
