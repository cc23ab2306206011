"""Coalescing (serving/shared/coalesce.py): the router sends concurrent generations' sweeps bound
for one host as one /v1/sweeps request; each generation's bytes stay those of `generate`, each
sweep is answered (or refused) on its own, and the envelope is capped and checked."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.model import Sampling
from blocktrain.serving import (
    HostSettings,
    ModelSource,
    create_host_app,
)
from blocktrain.serving.shared.batching import Batcher
from blocktrain.serving.shared.coalesce import pack, unpack_answers
from blocktrain.serving.shared.serving_errors import HostRefused
from blocktrain.serving.shared.wire import SamplingSpec, SweepHeader, decode, encode
from tests.serving.conftest import Runs, generate_together, in_process, start_cluster
from tests.serving.shared.test_trust import SECRET, asgi_post, endless

# Different prompts (longer and shorter than T = 16), seeds, samplers, sampling and lengths: the
# generations end at different traversals, so later requests carry fewer sweeps.
REQUESTS: list[dict[str, Any]] = [
    {"prompt": " = Valkyria Chronicles III = \n\n Senjo no ", "max_bytes": 9, "seed": 0},
    {"prompt": "The ", "max_bytes": 5, "seed": 7, "temperature": 0.7, "top_k": 20},
    {"prompt": "game ", "max_bytes": 8, "seed": 6, "sampler": "ancestral", "steps_per_block": 2},
    {"prompt": "Sega and ", "max_bytes": 3, "seed": 3, "top_p": 0.9},
    {"prompt": "a", "max_bytes": 6, "seed": 11, "steps_per_block": 3},
]


def expected(stack: Any, req: dict[str, Any]) -> list[int]:
    sampling = Sampling(req.get("temperature", 1.0), req.get("top_k", 0), req.get("top_p", 1.0))
    return in_process(
        stack,
        req["prompt"].encode(),
        req["max_bytes"],
        req["seed"],
        sampling,
        steps_per_block=req.get("steps_per_block", 1),
        sampler=req.get("sampler", "euler"),
    )


def bodies(reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"model": "bt", "steps_per_block": 1, **r} for r in reqs]


@pytest.mark.parametrize("sample_on", ["router", "last-host"])
def test_coalesced_generations_give_the_bytes_of_generate(runs, stack, sample_on):
    # Hosts without batching: the coalesced sweeps run one by one on the host, exactly as
    # each would alone, so the bytes are exact; batched forward passes differ by rounding only
    # (test_batching.py).
    cluster = start_cluster(runs, batch_rows=1)
    responses, router = generate_together(
        cluster,
        bodies(REQUESTS),
        sample_on=sample_on,
        coalesce_sweeps=64,
        coalesce_window_ms=50.0,
    )
    for req, r in zip(REQUESTS, responses, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["bytes"] == expected(stack, req), req
    coalesced = router.coalescer.describe()
    assert set(coalesced) == set(cluster.urls)
    assert all(c["largest"] == len(REQUESTS) for c in coalesced.values()), coalesced
    multi = [c for c in cluster.apps.calls if c.endswith("/v1/sweeps")]
    singles = [c for c in cluster.apps.calls if c.endswith("/v1/sweep")]
    assert multi, "nothing was coalesced"
    # 9 bytes at K = 2 is 5 traversals of 3 hosts; the lone last sweeps go to /v1/sweep.
    assert len(multi) + len(singles) == 3 * 5
    assert len(singles) < len(multi)


def test_without_coalescing_every_sweep_is_its_own_request(runs, stack):
    cluster = start_cluster(runs, batch_rows=1)
    responses, router = generate_together(cluster, bodies(REQUESTS[:3]), coalesce_sweeps=1)
    assert [r.json()["bytes"] for r in responses] == [expected(stack, q) for q in REQUESTS[:3]]
    assert router.coalescer.describe() == {}
    assert not [c for c in cluster.apps.calls if c.endswith("/v1/sweeps")]


# --------------------------------------------------------------------------- the host's route


def solo(runs: Runs, **settings: Any) -> Any:
    """One host holding every block: a sweep ends there with its answer."""
    return create_host_app(
        HostSettings(
            models=(ModelSource("bt", runs.blocktrain),),
            parts=(0, 1, 2),
            public_url="http://solo:8100",
            batch_rows=1,
            **settings,
        )
    )


def sweep_bodies(app: Any, lengths: list[tuple[int, int]]) -> list[bytes]:
    """One /v1/sweep body per (rows, context length), each with its own generator."""
    model = app.state.host.models["bt"]
    cfg = model.config.model
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, (rows, length) in enumerate(lengths):
        header = SweepHeader(
            model="bt",
            fingerprint=model.fingerprint,
            step=0,
            final="bytes" if i % 2 else "logits",
            sampling=SamplingSpec(),
        )
        tensors = {
            "x": torch.randint(0, 256, (rows, length), generator=gen, dtype=torch.uint8),
            "z": 5 * torch.randn(rows, cfg.span, cfg.d_model, generator=gen),
            "generator": torch.Generator().manual_seed(100 + i).get_state(),
        }
        out.append(encode(tensors, header.model_dump()))
    return out


def test_a_host_answers_each_sweep_of_a_request_to_its_own_sender(runs):
    app = solo(runs)
    bodies = sweep_bodies(app, [(1, 3), (2, 9), (1, 12), (3, 5)])
    with TestClient(app) as host:
        alone = [decode(host.post("/v1/sweep", content=b).content)[0] for b in bodies]
        r = host.post("/v1/sweeps", content=pack(bodies))
    assert r.status_code == 200, r.text
    outcomes = unpack_answers(r.content, len(bodies), "http://solo:8100")
    for i, (outcome, single) in enumerate(zip(outcomes, alone, strict=True)):
        assert isinstance(outcome, tuple), outcome
        answer = decode(outcome[0])[0]
        assert answer.keys() == single.keys()
        key = "bytes" if i % 2 else "logits"
        assert answer[key].shape[0] == (1, 2, 1, 3)[i], "each sender gets its own rows"
        torch.testing.assert_close(answer[key], single[key], rtol=1e-4, atol=1e-5)
        if "generator" in single:
            assert torch.equal(answer["generator"], single["generator"])
        assert outcome[1][0].host == "http://solo:8100"


def test_a_bad_sweep_is_refused_alone_and_the_others_are_answered(runs):
    app = solo(runs)
    good = sweep_bodies(app, [(1, 4), (1, 6)])
    wrong_run = decode(good[0])
    wrong_run[1]["fingerprint"] = "not-this-run"
    bad = [b"not safetensors", encode(*wrong_run)]
    with TestClient(app) as host:
        r = host.post("/v1/sweeps", content=pack([good[0], bad[0], bad[1], good[1]]))
    assert r.status_code == 200, r.text
    outcomes = unpack_answers(r.content, 4, "http://solo:8100")
    # As a single sweep's refusal would reach the router: its status, code and reason.
    assert isinstance(outcomes[1], HostRefused) and outcomes[1].status == 400
    assert outcomes[1].code == "bad_payload" and "safetensors" in outcomes[1].message
    assert isinstance(outcomes[2], HostRefused)
    assert outcomes[2].code == "fingerprint_mismatch" and outcomes[2].status == 409
    assert all(isinstance(outcomes[i], tuple) for i in (0, 3))


@pytest.mark.parametrize(
    ("tensors", "count", "reason"),
    [
        ({str(i): torch.zeros(4, dtype=torch.uint8) for i in range(5)}, 5, "1..4 sweeps"),
        ({"0": torch.zeros(4, dtype=torch.uint8)}, 0, "1..4 sweeps"),
        ({"0": torch.zeros(4, dtype=torch.uint8)}, 2, "tensors 0..1"),
        ({"0": torch.zeros(2, 2, dtype=torch.uint8)}, 1, "(B,) uint8"),
        ({"0": torch.zeros(4)}, 1, "(B,) uint8"),
    ],
)
def test_a_malformed_or_oversized_envelope_is_refused_whole(runs, tensors, count, reason):
    app = solo(runs, max_batch=4)
    with TestClient(app) as host:
        r = host.post("/v1/sweeps", content=encode(tensors, {"count": count}))
        garbage = host.post("/v1/sweeps", content=b"\x80\x04pickle")
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]
    assert garbage.status_code == 400
    assert app.state.host.batcher.stats.jobs == 0, "nothing ran"


def test_the_multi_sweep_route_needs_the_secret_before_its_body(runs):
    cluster = start_cluster(runs, secret=SECRET)
    status, answer, pulled = asgi_post(
        cluster.apps.apps[cluster.urls[0]], "/v1/sweeps", endless(), {}
    )
    assert status == 401 and pulled == 0
    assert "shared secret" in answer["error"]["message"]


def test_an_async_batch_runs_on_the_loop_and_its_error_reaches_each_job():
    calls: list[list[int]] = []

    async def run(key: str, jobs: list[int]) -> list[int]:
        calls.append(jobs)
        await asyncio.sleep(0)
        if 13 in jobs:
            raise ValueError("unlucky")
        return [j * 2 for j in jobs]

    batcher: Batcher[str, int, int] = Batcher(run, window_s=0.0, max_rows=2)

    async def main() -> list[int | BaseException]:
        return await asyncio.gather(
            *(batcher.submit("k", 1, j) for j in (1, 2, 13, 4)), return_exceptions=True
        )

    out = asyncio.run(main())
    assert calls == [[1, 2], [13, 4]]
    assert out[:2] == [2, 4]
    assert all(isinstance(o, ValueError) for o in out[2:])
