"""Batching on a block host: concurrent sweeps at the same grid point share one forward pass
(contexts of different lengths right-aligned), give what each would alone (up to float
rounding), and keep each request's randomness its own."""

from __future__ import annotations

import asyncio

import pytest
import torch

from blocktrain.serving import (
    HostSettings,
    ModelSource,
    create_host_app,
)
from blocktrain.serving.host.block_host import BlockHost
from blocktrain.serving.shared.batching import Batcher
from blocktrain.serving.shared.wire import SamplingSpec, SweepHeader, decode, encode
from tests.serving.conftest import Cluster, Runs, generate_together, start_cluster

N = 6


def test_jobs_submitted_together_run_as_batches_per_key_up_to_max_rows():
    calls: list[tuple[str, list[int]]] = []

    def run(key: str, jobs: list[int]) -> list[int]:
        calls.append((key, jobs))
        return [j * 10 for j in jobs]

    batcher: Batcher[str, int, int] = Batcher(run, window_s=0.0, max_rows=3)

    async def main() -> list[int]:
        jobs = [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("a", 5)]
        return await asyncio.gather(*(batcher.submit(k, 1, j) for k, j in jobs))

    assert asyncio.run(main()) == [10, 20, 30, 40, 50]
    assert calls == [("a", [1, 3, 4]), ("b", [2]), ("a", [5])], "oldest bucket first"
    assert batcher.stats.describe()["largest"] == 3


def test_one_row_per_batch_is_batching_off_and_a_batch_error_reaches_each_job():
    def run(key: str, jobs: list[int]) -> list[int]:
        if 13 in jobs:
            raise ValueError("unlucky")
        return jobs

    batcher: Batcher[str, int, int] = Batcher(run, window_s=0.0, max_rows=1)

    async def main() -> list[int | BaseException]:
        return await asyncio.gather(
            *(batcher.submit("k", 1, j) for j in (1, 13, 2)), return_exceptions=True
        )

    out = asyncio.run(main())
    assert out[0] == 1 and out[2] == 2
    assert isinstance(out[1], ValueError)
    assert batcher.stats.batches == 3 and batcher.stats.largest == 1


def host_of(runs: Runs, batch_rows: int) -> BlockHost:
    """One host holding every block of the micro run: a sweep ends there with its answer."""
    settings = HostSettings(
        models=(ModelSource("bt", runs.blocktrain),),
        parts=(0, 1, 2),
        public_url="http://solo:8100",
        batch_rows=batch_rows,
        batch_window_ms=0.0,
    )
    host = create_host_app(settings).state.host
    assert isinstance(host, BlockHost)
    return host


def requests(host: BlockHost, lengths: list[int], sampler: str, final: str) -> list[bytes]:
    model = host.models["bt"]
    cfg = model.config.model
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, length in enumerate(lengths):
        header = SweepHeader(
            model="bt",
            fingerprint=model.fingerprint,
            step=0,
            steps_per_block=2,
            sampler=sampler,
            final=final,  # type: ignore[arg-type]
            sampling=SamplingSpec(temperature=1.0),
        )
        tensors = {
            "x": torch.randint(0, 256, (1, length), generator=gen, dtype=torch.uint8),
            "z": 5 * torch.randn(1, cfg.span, cfg.d_model, generator=gen),
            "generator": torch.Generator().manual_seed(100 + i).get_state(),
        }
        out.append(encode(tensors, header.model_dump()))
    return out


def run_all(host: BlockHost, bodies: list[bytes]) -> list[dict[str, torch.Tensor]]:
    async def main() -> list[tuple[bytes, object]]:
        return await asyncio.gather(*(host.sweep(b) for b in bodies))

    return [decode(answer)[0] for answer, _ in asyncio.run(main())]


@pytest.mark.parametrize("sampler", ["euler", "ancestral"])
def test_concurrent_sweeps_share_a_forward_pass_and_match_running_alone(runs, sampler):
    batched, alone = host_of(runs, batch_rows=64), host_of(runs, batch_rows=1)
    bodies = requests(batched, [5] * N, sampler, "logits")
    together, apart = run_all(batched, bodies), run_all(alone, bodies)
    assert batched.batcher.stats.batches == 1 and batched.batcher.stats.largest == N
    assert alone.batcher.stats.batches == N
    for t, a in zip(together, apart, strict=True):
        if sampler == "ancestral":
            # Each request drew its noise from its own generator, exactly as much as alone.
            assert torch.equal(t["generator"], a["generator"])
        torch.testing.assert_close(t["logits"], a["logits"], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(together[0]["logits"], together[1]["logits"]), "rows stay apart"


def test_bytes_drawn_on_the_host_use_each_request_s_own_generator(runs):
    batched, alone = host_of(runs, batch_rows=64), host_of(runs, batch_rows=1)
    bodies = requests(batched, [4] * N, "ancestral", "bytes")
    together, apart = run_all(batched, bodies), run_all(alone, bodies)
    assert batched.batcher.stats.largest == N
    for t, a in zip(together, apart, strict=True):
        assert torch.equal(t["generator"], a["generator"])
        assert t["bytes"].shape == a["bytes"].shape == (1, batched.models["bt"].config.model.span)
    states = {bytes(t["generator"].tolist()) for t in together}
    assert len(states) == N, "every request's generator advanced on its own"


def test_sweeps_of_different_context_lengths_share_a_batch_by_the_positions_they_compute(runs):
    """Contexts of different lengths run right-aligned in one pass (model/cached.py), bucketed
    by the clean positions they compute (here, without caches, their lengths: 3 | 5, 7 | 12),
    and each gets what it would alone."""
    batched, alone = host_of(runs, batch_rows=64), host_of(runs, batch_rows=1)
    bodies = requests(batched, [3, 5, 3, 5, 7, 12], "euler", "logits")
    together, apart = run_all(batched, bodies), run_all(alone, bodies)
    assert batched.batcher.stats.batches == 3, "one batch per bucket: 1-4, 5-8, 9-16"
    info = batched.info()["batching"]
    assert info["jobs"] == 6 and info["largest"] == 3 and info["max_rows"] == 64
    for t, a in zip(together, apart, strict=True):
        torch.testing.assert_close(t["logits"], a["logits"], rtol=1e-4, atol=1e-5)


def test_concurrent_requests_through_the_router_are_batched_on_the_hosts(runs):
    cluster: Cluster = start_cluster(runs, batch_window_ms=100.0)
    body = {"model": "bt", "prompt": "The ", "max_bytes": 6}
    responses, _ = generate_together(cluster, [{**body, "seed": s} for s in range(N)])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert all(r.json()["output_bytes"] == 6 for r in responses)
    hosts = [cluster.apps.apps[url].state.host for url in cluster.urls]  # type: ignore[attr-defined]
    largest = [h.batcher.stats.largest for h in hosts]
    assert max(largest) > 1, f"no host batched concurrent sweeps: {largest}"
    assert sum(h.batcher.stats.jobs for h in hosts) == 3 * 3 * N, "3 spans x 3 hosts per request"
