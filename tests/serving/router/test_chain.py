"""One sweep across hosts gives exactly the in-process sampler's bytes; the autoregressive
pipeline gives the reference's; hosts refuse state that is not theirs."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.model import (
    Reference,
    Sampling,
    SigmaSchedule,
    ZLayout,
    one_sweep,
    stack_denoiser,
)
from blocktrain.serving.shared.wire import CONTENT_TYPE, TRACE_HEADER, decode, encode
from blocktrain.training import load_model
from tests.serving.conftest import in_process, start_cluster

PROMPT = b" = Valkyria Chronicles III = \n\n Senjo no "  # 42 bytes: longer than T = 16


@pytest.mark.parametrize("sample_on", ["router", "last-host"])
@pytest.mark.parametrize(
    ("seed", "n", "sampling"),
    [
        (0, 9, {}),
        (7, 16, {"temperature": 0.7, "top_k": 20}),
        (11, 5, {"top_p": 0.9}),
    ],
)
def test_chained_sweep_gives_the_in_process_samplers_bytes(
    cluster, stack, sample_on, seed, n, sampling
):
    with cluster.router(sample_on=sample_on) as router:
        r = router.post(
            "/v1/generate",
            json={
                "model": "bt",
                "prompt": PROMPT.decode(),
                "max_bytes": n,
                "seed": seed,
                **sampling,
            },
        )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = in_process(stack, PROMPT, n, seed, Sampling(**sampling))
    # The hosts run the very loop of generate() (model.sampler.run_points), with the fp32 state
    # passed exactly; their cached forward differs from Block.forward by float rounding only,
    # far too little to move a byte drawn here.
    assert body["bytes"] == expected, "the chain must reproduce generate()'s bytes"
    assert body["traversals"] == -(-n // stack.cfg.span), "one traversal per span of K bytes"
    assert body["hosts"] == cluster.urls


@pytest.mark.parametrize("parts", [[(0, 1), (2,)], [(0,), (1, 2)], [(0, 2), (1,)], [(0, 1, 2)]])
def test_any_split_of_blocks_over_hosts_gives_the_same_bytes(runs, stack, parts):
    cluster = start_cluster(runs, parts)
    with cluster.router() as router:
        r = router.post(
            "/v1/generate", json={"model": "bt", "prompt": "Sega and ", "max_bytes": 7, "seed": 3}
        )
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == in_process(stack, b"Sega and ", 7, 3)
    if parts == [(0, 2), (1,)]:
        assert r.json()["hosts"] == [cluster.urls[0], cluster.urls[1], cluster.urls[0]]


def test_steps_per_block_are_run_on_the_blocks_host(cluster, stack):
    with cluster.router() as router:
        r = router.post(
            "/v1/generate",
            json={
                "model": "bt",
                "prompt": "game ",
                "max_bytes": 4,
                "seed": 5,
                "steps_per_block": 3,
            },
        )
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == in_process(stack, b"game ", 4, 5, steps_per_block=3)
    sweeps = [c for c in cluster.apps.calls if c.endswith("/v1/sweep")]
    assert len(sweeps) == 3 * 2, "3 hosts per traversal, 2 traversals, whatever the steps"


@pytest.mark.parametrize("sample_on", ["router", "last-host"])
def test_the_ancestral_sampler_draws_its_noise_on_the_hosts_from_the_requests_generator(
    cluster, stack, sample_on
):
    request = {"model": "bt", "prompt": "game ", "max_bytes": 5, "seed": 6, "steps_per_block": 2}
    with cluster.router(sample_on=sample_on) as router:
        r = router.post("/v1/generate", json={**request, "sampler": "ancestral"})
        euler = router.post("/v1/generate", json=request)
    assert r.status_code == 200, r.text
    expected = in_process(stack, b"game ", 5, 6, steps_per_block=2, sampler="ancestral")
    assert r.json()["bytes"] == expected, "the generator state travels with z and comes back"
    assert expected != in_process(stack, b"game ", 5, 6, steps_per_block=2)
    assert euler.json()["bytes"] == in_process(stack, b"game ", 5, 6, steps_per_block=2)


def test_an_ancestral_sweep_without_the_generator_state_is_refused(cluster, stack):
    x, z, _ = _sweep_message(stack, _fingerprint(cluster))
    header = {"model": "bt", "fingerprint": _fingerprint(cluster), "step": 0}
    body = encode({"x": x, "z": z}, {**header, "sampler": "ancestral"})
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=body)
        unknown = host0.post(
            "/v1/sweep", content=encode({"x": x, "z": z}, {**header, "sampler": "heun"})
        )
    assert r.status_code == 400, r.text
    assert "ancestral sampler needs the generator state" in r.json()["error"]["message"]
    assert unknown.status_code == 400 and "unknown sampler 'heun'" in unknown.text


def test_fp16_state_on_the_wire_halves_the_state_and_still_generates(cluster):
    sizes: list[int] = []

    def record(url, request):
        if request.url.path == "/v1/sweep" and url == cluster.urls[1]:
            tensors, _ = decode(request.content)
            sizes.append(tensors["z"].element_size())

    cluster.apps.before = record
    with cluster.router(wire_dtype="fp16") as router:
        r = router.post("/v1/generate", json={"model": "bt", "prompt": "The ", "max_bytes": 6})
    assert r.status_code == 200 and r.json()["output_bytes"] == 6, r.text
    assert sizes and set(sizes) == {2}, "fp16 on every hop"


def test_autoregressive_pipeline_gives_the_references_greedy_bytes(cluster, runs):
    _, ref = load_model(runs.reference)
    assert isinstance(ref, Reference)
    prompt = b"Chronicles"
    with cluster.router() as router:
        r = router.post(
            "/v1/generate",
            json={"model": "ref", "prompt": prompt.decode(), "max_bytes": 5, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    out = r.json()["bytes"]
    assert len(out) == 5
    # The pipeline computes one token at a time against KV caches, the reference a whole
    # context at once: other shapes, so the logits agree to rounding, not bit for bit, and a
    # near-tie may break either way. Compare decisions: each byte the pipeline chose must be a
    # greedy choice of the reference's own logits on the same context, up to that rounding.
    with torch.no_grad():
        logits = ref(torch.tensor([list(prompt) + out]))[0]  # (L, 256)
    for i, byte in enumerate(out):
        row = logits[len(prompt) - 1 + i]
        assert row[byte] >= row.max() - 1e-4, f"byte {i}: {byte} is not the reference's argmax"
    assert r.json()["traversals"] == 5, "one traversal of the chain per byte"
    for url in cluster.urls:
        assert len(cluster.apps.apps[url].state.host.sessions) == 0, "caches dropped at the end"


def test_autoregressive_pipeline_runs_past_the_context_and_is_seeded(cluster):
    with cluster.router() as router:

        def go(seed):
            r = router.post(
                "/v1/generate",
                json={"model": "ref", "prompt": "x" * 30, "max_bytes": 40, "seed": seed},
            )
            assert r.status_code == 200, r.text
            return r.json()["bytes"]

        assert len(go(1)) == 40
        assert go(1) == go(1) and go(1) != go(2)


def test_a_stage_that_lost_its_cache_is_prefilled_again(cluster):
    steps = {"n": 0}

    def forget(url, request):
        if url == cluster.urls[1] and request.url.path == "/v1/stage":
            steps["n"] += 1
            if steps["n"] == 3:  # host 1 "restarts" between two bytes
                cluster.apps.apps[url].state.host.sessions._items.clear()

    with cluster.router() as router:
        baseline = router.post(
            "/v1/generate", json={"model": "ref", "prompt": "abc", "max_bytes": 6, "temperature": 0}
        )
        cluster.apps.before = forget
        r = router.post(
            "/v1/generate", json={"model": "ref", "prompt": "abc", "max_bytes": 6, "temperature": 0}
        )
    assert r.status_code == 200, r.text
    assert r.json()["output_bytes"] == 6
    assert r.json()["bytes"][:2] == baseline.json()["bytes"][:2]


def _sweep_message(stack, fingerprint, step=0, model="bt"):
    cfg = stack.cfg
    x = torch.tensor([list(b"Valkyria")], dtype=torch.uint8)
    z = cfg.sigma_max * torch.randn(
        1, cfg.span, cfg.d_model, generator=torch.Generator().manual_seed(0)
    )
    header = {"model": model, "fingerprint": fingerprint, "step": step}
    return x, z, encode({"x": x, "z": z}, header)


def _fingerprint(cluster):
    return cluster.apps.apps[cluster.urls[0]].state.host.models["bt"].fingerprint


def test_a_chain_without_router_follows_next_and_matches_one_sweep(runs, stack):
    cluster = start_cluster(runs, next_urls=True)
    x, z, body = _sweep_message(stack, _fingerprint(cluster))
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=body, headers={"content-type": CONTENT_TYPE})
    assert r.status_code == 200, r.text
    logits = decode(r.content)[0]["logits"]
    cfg = stack.cfg
    expected = one_sweep(
        stack_denoiser(stack),
        x.long(),
        z,
        SigmaSchedule.from_config(cfg).sampler_grid(1),
        stack.targets,
        ZLayout.next_span(x.shape[1], cfg.span),
    )
    # The same run_points, the fp32 state passed exactly; the hosts run the cached forward
    # (model/cached.py), the same math in another order: equal up to float rounding.
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    trace = r.headers[TRACE_HEADER]
    assert all(url in trace for url in cluster.urls), "every host reports its compute"


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"fingerprint": "0123456789abcdef"}, "fingerprint_mismatch"),
        ({"step": 1}, "misrouted"),
        ({"model": "nope"}, "unknown_model"),
        ({"model": "ref"}, "host_refused"),
    ],
)
def test_a_host_refuses_state_that_is_not_its_own(cluster, stack, change, code):
    args = {"fingerprint": _fingerprint(cluster), **change}
    _, _, body = _sweep_message(stack, **args)
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=body)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == code, r.json()
    assert r.json()["error"]["host"] == cluster.urls[0]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not safetensors", "not a complete safetensors body"),
        (encode({"x": torch.zeros(1, 4, dtype=torch.uint8)}, {"model": "bt"}), "fingerprint"),
    ],
)
def test_a_host_rejects_malformed_messages(cluster, body, reason):
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=body)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]


def test_a_host_rejects_bad_state(cluster, stack):
    fp = _fingerprint(cluster)
    x = torch.tensor([list(b"abc")], dtype=torch.uint8)
    bad = {
        "wrong shape": {"x": x, "z": torch.zeros(1, 3, stack.cfg.d_model)},
        "non-finite": {
            "x": x,
            "z": torch.full((1, stack.cfg.span, stack.cfg.d_model), float("nan")),
        },
        "context too long": {
            "x": torch.zeros(1, 100, dtype=torch.uint8),
            "z": torch.zeros(1, stack.cfg.span, stack.cfg.d_model),
        },
    }
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        for what, tensors in bad.items():
            r = host0.post(
                "/v1/sweep", content=encode(tensors, {"model": "bt", "fingerprint": fp, "step": 0})
            )
            assert r.status_code == 400, f"{what}: {r.text}"


def test_a_host_refuses_verify_draws_on_a_span_model(cluster, stack):
    """draws > 1 makes a verify sweep, which needs a K = 1 model: one clear 400 naming draws."""
    assert stack.cfg.span > 1
    x = torch.tensor([list(b"abc")], dtype=torch.uint8)
    z = torch.zeros(1, 2, stack.cfg.d_model)
    header = {"model": "bt", "fingerprint": _fingerprint(cluster), "step": 0, "draws": 2}
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        r = host0.post("/v1/sweep", content=encode({"x": x, "z": z}, header))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "draws" and "K = 1" in r.json()["error"]["message"]


def test_a_host_refuses_a_fork_the_sampler_cannot_make_and_copies_before_it(cluster):
    """Draws fork only under the ancestral sampler, at a point of the grid, and before the fork
    z holds one copy of the tokens: each wrong header is one 400 naming its field."""
    host = cluster.apps.apps[cluster.urls[0]].state.host
    d_model = host.models["bt1"].config.model.d_model
    x = torch.tensor([list(b"abcde")], dtype=torch.uint8)  # 3 context bytes, 2 drafted
    gen = torch.Generator().manual_seed(0).get_state()
    header = {
        "model": "bt1",
        "fingerprint": host.models["bt1"].fingerprint,
        "step": 0,
        "drafted": 2,
        "draws": 4,
        "sampler": "ancestral",
    }
    one_copy = {"x": x, "z": torch.zeros(1, 3, d_model), "generator": gen}
    cases = {
        "fork": [
            ({**header, "fork": 2, "sampler": "euler"}, one_copy),
            ({**header, "fork": 2, "draws": 1}, one_copy),
            ({**header, "fork": 99}, one_copy),
        ],
        "z": [({**header, "fork": 2}, {**one_copy, "z": torch.zeros(1, 12, d_model)})],
    }
    with TestClient(cluster.apps.apps[cluster.urls[0]]) as host0:
        for param, bodies in cases.items():
            for head, tensors in bodies:
                r = host0.post("/v1/sweep", content=encode(tensors, head))
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == param, r.text
        ok = host0.post("/v1/sweep", content=encode(one_copy, {**header, "fork": 2}))
    assert ok.status_code == 200, ok.text
