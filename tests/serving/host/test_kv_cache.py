"""The block hosts' clean-stream caches per generation (serving/host/sweeps.py, sessions.py): a
generation's later sweeps compute only the new context positions, give what a sweep without a
cache gives, trust nothing but the bytes, stay within their bounds and go after the last sweep."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.cli.main import main
from blocktrain.serving import HostSettings, ModelSource, create_host_app
from blocktrain.serving.host.block_host import BlockHost
from blocktrain.serving.shared.wire import SweepHeader, decode, encode
from tests.cli.test_cli import fails_cleanly
from tests.serving.conftest import Cluster, Runs, in_process, start_cluster
from tests.serving.router.test_speculative import DRAFTER

TOL = {"rtol": 1e-4, "atol": 1e-5}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def solo(runs: Runs, clock: Clock | None = None, **settings: object) -> BlockHost:
    """One host holding every block of the K = 2 micro run: each sweep ends there."""
    app = create_host_app(
        HostSettings(
            models=(ModelSource("bt", runs.blocktrain),),
            parts=(0, 1, 2),
            public_url="http://solo:8100",
            batch_window_ms=0.0,
            **settings,  # type: ignore[arg-type]
        ),
        clock=clock or Clock(),
    )
    host = app.state.host
    assert isinstance(host, BlockHost)
    return host


def body(host: BlockHost, x: torch.Tensor, seed: int, **header: object) -> bytes:
    model = host.models["bt"]
    cfg = model.config.model
    z = 5 * torch.randn(
        x.shape[0], cfg.span, cfg.d_model, generator=torch.Generator().manual_seed(seed)
    )
    head = SweepHeader(model="bt", fingerprint=model.fingerprint, step=0, **header)  # type: ignore[arg-type]
    return encode({"x": x.to(torch.uint8), "z": z}, head.model_dump())


def logits(host: BlockHost, *bodies: bytes) -> list[torch.Tensor]:
    async def main() -> list[tuple[bytes, object]]:
        return await asyncio.gather(*(host.sweep(b) for b in bodies))

    return [decode(answer)[0]["logits"] for answer, _ in asyncio.run(main())]


def context(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def positions(host: BlockHost) -> tuple[int, int]:
    info = host.info()["kv_cache"]
    return info["positions_computed"], info["positions_reused"]


def test_a_generation_s_next_sweeps_compute_only_the_new_positions(runs):
    host, plain = solo(runs), solo(runs, kv_cache=False)
    x = context(2, 12)
    for length, seed in ((6, 1), (8, 2), (9, 3), (12, 4)):  # K = 2 and other steps
        got = logits(host, body(host, x[:, :length], seed, session="g1"))[0]
        want = logits(plain, body(plain, x[:, :length], seed, session="g1"))[0]
        torch.testing.assert_close(got, want, **TOL)
    # 3 blocks x 2 rows: the first sweep computes 6 positions, each later one what it adds.
    assert positions(host) == (3 * 2 * 12, 3 * 2 * (6 + 8 + 9))
    assert positions(plain) == (3 * 2 * (6 + 8 + 9 + 12), 0)
    assert host.info()["kv_cache"]["sessions"] == 1 and plain.info()["kv_cache"]["sessions"] == 0


@pytest.mark.parametrize(
    "change",
    ["other bytes", "other rows", "window moved", "another session", "no session"],
)
def test_a_sweep_whose_context_does_not_extend_the_cache_recomputes_it(runs, change):
    """The cache is reused only as far as the bytes agree: a caller's claim counts for nothing."""
    host, plain = solo(runs), solo(runs, kv_cache=False)
    x = context(2, 10)
    logits(host, body(host, x[:, :8], 1, session="g1"))
    nxt, session = x, "g1"
    if change == "other bytes":
        nxt = x.clone()
        nxt[:, 3] += 1
    elif change == "other rows":
        nxt = x[:1]
    elif change == "window moved":
        nxt = torch.cat((x[:, 2:], x[:, :2]), dim=1)
    elif change == "another session":
        session = "g2"
    header = {} if change == "no session" else {"session": session}
    before = positions(host)
    got = logits(host, body(host, nxt, 2, **header))[0]
    want = logits(plain, body(plain, nxt, 2))[0]
    torch.testing.assert_close(got, want, **TOL)
    computed = positions(host)[0] - before[0]
    expected_prefix = {"other bytes": 3, "other rows": 0, "window moved": 0}.get(change, 0)
    assert computed == 3 * nxt.shape[0] * (nxt.shape[1] - expected_prefix)


def test_generations_of_different_lengths_batch_and_match_their_own_sweeps(runs):
    host, plain = solo(runs), solo(runs, batch_rows=1, kv_cache=False)
    contexts = [context(1, 5, 1), context(2, 9, 2), context(1, 13, 3)]
    for i, x in enumerate(contexts):  # each generation's first sweep, one by one
        logits(host, body(host, x[:, :-1], 10 + i, session=f"g{i}"))
    bodies = [body(host, x, 20 + i, session=f"g{i}") for i, x in enumerate(contexts)]
    batched = logits(host, *bodies)
    assert host.batcher.stats.largest == 3, "one new byte each: one batch"
    for got, want in zip(batched, logits(plain, *bodies), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_the_last_sweep_drops_the_cache_and_the_bounds_hold(runs):
    clock = Clock()
    host = solo(runs, clock)
    logits(host, body(host, context(1, 8), 1, session="a"))
    logits(host, body(host, context(1, 9), 2, session="a", close=True))
    assert host.info()["kv_cache"]["sessions"] == 0 and host.sessions.nbytes == 0
    logits(host, body(host, context(1, 8), 1, session="b"))
    clock.now = 601.0  # past the time to live: the next use of the store drops it
    logits(host, body(host, context(1, 8, 5), 1, session="c"))
    assert host.info()["kv_cache"]["sessions"] == 1
    one = host.sessions.nbytes
    capped = solo(runs, clock, max_cache_bytes=one + one // 2)  # room for one generation
    for name in "xyz":
        logits(capped, body(capped, context(1, 8), 1, session=name))
    assert len(capped.sessions) == 1 and capped.sessions.nbytes <= one + one // 2
    assert capped.sessions.clean("bt", "z", [0, 1, 2]), "the most recent one stays"


def test_chains_with_and_without_the_cache_give_generate_s_bytes(runs, stack):
    cached, plain = start_cluster(runs), start_cluster(runs, kv_cache=False)
    request = {"model": "bt", "prompt": "Sega ", "max_bytes": 8, "seed": 5}
    answers = []
    for cluster in (cached, plain):
        with cluster.router() as router:
            r = router.post("/v1/generate", json=request)
        assert r.status_code == 200, r.text
        answers.append(r.json()["bytes"])
    assert answers[0] == answers[1] == in_process(stack, b"Sega ", 8, 5)
    hosts = [cached.apps.apps[u].state.host for u in cached.urls]  # type: ignore[attr-defined]
    reused = [positions(h)[1] for h in hosts]
    # 4 sweeps of 5, 7, 9, 11 bytes: the last three reuse 5 + 7 + 9 positions on each host.
    assert reused == [21, 21, 21]
    assert all(len(h.sessions) == 0 for h in hosts), "the last sweep closed the generation"
    plain_hosts = [plain.apps.apps[u].state.host for u in plain.urls]  # type: ignore[attr-defined]
    assert all(positions(h)[1] == 0 for h in plain_hosts)


def test_verify_sweeps_reuse_the_accepted_bytes(cluster: Cluster):
    # T = 16: the prompt, 6 bytes and a draft of 3 stay within the window (it never moves).
    request = {"model": "bt1", "prompt": "Val ", "max_bytes": 6, "seed": 4}
    with cluster.router(drafter=DRAFTER) as router:
        r = router.post("/v1/generate", json={**request, "draft_bytes": 3})
    assert r.status_code == 200, r.text
    assert r.json()["traversals"] > 1
    host = cluster.apps.apps[cluster.urls[0]].state.host  # type: ignore[attr-defined]
    # Each later sweep reuses at least the prompt and what was accepted before it.
    assert positions(host)[1] >= 4 * (r.json()["traversals"] - 1), "each later sweep reuses"
    hosts = [cluster.apps.apps[u].state.host for u in cluster.urls]  # type: ignore[attr-defined]
    assert all(len(h.sessions) == 0 for h in hosts), "never closed, so released at its end"


def test_a_generation_cut_by_a_stop_sequence_releases_its_caches(cluster: Cluster):
    """It ends before its closing sweep: the router tells the hosts it used to drop its caches
    (POST /v1/release) instead of leaving them to the store's bounds."""
    request = {"model": "bt", "prompt": "Sega ", "max_tokens": 12, "seed": 5}
    hosts = [cluster.apps.apps[u].state.host for u in cluster.urls]  # type: ignore[attr-defined]
    with cluster.router() as router:
        full = router.post("/v1/completions", json=request).json()["choices"][0]["text"]
        stop = full[4]
        cut = router.post("/v1/completions", json={**request, "stop": [stop]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and len(cut["choices"][0]["text"]) < 12
    assert all(len(h.sessions) == 0 for h in hosts)
    assert sum(positions(h)[1] for h in hosts) > 0, "the cache was used, then released"


def test_the_release_endpoint_drops_one_session_and_refuses_a_bad_body(runs):
    app = create_host_app(
        HostSettings(
            models=(ModelSource("bt", runs.blocktrain),), parts=(0, 1, 2), batch_window_ms=0.0
        ),
    )
    host = app.state.host
    logits(host, body(host, context(1, 8), 1, session="a"))
    logits(host, body(host, context(1, 8), 1, session="b"))
    with TestClient(app) as http:
        first = http.post("/v1/release", json={"model": "bt", "session": "a"})
        assert first.status_code == 200 and first.json() == {"released": True}
        again = http.post("/v1/release", json={"model": "bt", "session": "a"})
        assert again.status_code == 200 and again.json() == {"released": False}
        for bad in ('{"model": "bt"}', '{"model": "bt", "session": "b", "x": 1}', "[]", "no"):
            r = http.post("/v1/release", content=bad)
            assert r.status_code == 400 and "not a release request" in r.text, bad
    assert host.sessions.clean("bt", "b", [0, 1, 2]), "the other generation keeps its caches"


def test_serve_block_takes_the_cache_flags(capsys, runs):
    with pytest.raises(SystemExit):
        main(["serve-block", "--help"])
    out = capsys.readouterr().out
    assert "--no-kv-cache" in out and "--max-cache-mb 256" in out, "flags and an example"
    run = str(runs.blocktrain)
    for bad in ("0", "-5", "nan"):
        fails_cleanly(
            capsys,
            ["serve-block", run, "--blocks", "0", "--port", "0", "--max-cache-mb", bad],
            "--max-cache-mb",
        )


def test_a_generation_past_the_window_recomputes_its_context_only_when_the_window_restarts(
    cluster, stack
):
    """The one-sweep window stands still while the context fits (T - K bytes) and then
    restarts at the last (T - K) // 2 (model.span_loop.window_start): a long generation's sweeps
    compute their new bytes, plus the kept half at each restart, where a window sliding a span
    per sweep would recompute all T - K bytes at every sweep."""
    cfg = stack.cfg
    cap, n, prompt = cfg.seq_len - cfg.span, 40, b"The "
    with cluster.router() as router:
        r = router.post(
            "/v1/generate", json={"model": "bt", "prompt": "The ", "max_bytes": n, "seed": 0}
        )
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == in_process(stack, prompt, n, 0), "the law of `generate`"
    computed = positions(cluster.apps.apps[cluster.urls[0]].state.host)[0]
    restarts = n // (cap - cap // 2) + 1
    assert computed <= len(prompt) + n + restarts * (cap // 2), computed
    sweeps = -(-n // cfg.span)
    assert computed < sweeps * cap // 2, "a sliding window would compute about sweeps * cap"
