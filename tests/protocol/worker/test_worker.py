"""The worker's client and loop, against the aggregator app in this process: retries with
backoff, refusals, re-sync after a restart, clean stop."""

from __future__ import annotations

import dataclasses
import random
import threading

import httpx
import pytest
import torch

from blocktrain.errors import Refused, Unreachable
from blocktrain.protocol.core.settings import AggregatorSettings, declared
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.loop import WorkerLoop
from blocktrain.protocol.worker.retrying import RetryPolicy
from tests.protocol.conftest import Harness, auth, delta_body, make_harness

SETTINGS = AggregatorSettings(
    deadline_s=30,
    local_steps=3,
    max_delta_norm=50,
    max_tokens=10_000,
    max_rounds=4,
    min_round_s=0.0,  # the fake clock does not move while the loop runs
)


class FakeTrainer:
    """Stands in for LocalBlockTrainer: a fixed delta, and hooks for tests."""

    def __init__(self, on_train=None, upstream_blocks=()) -> None:
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.first_steps: list[int] = []
        self.on_train = on_train
        self.upstream_blocks = list(upstream_blocks)
        self.upstream: list[dict[int, dict[str, torch.Tensor]]] = []

    def load(self, weights):
        self.loaded.append(weights)

    def load_upstream(self, blocks):
        self.upstream.append(blocks)

    def train(self, steps, first_step, should_stop):
        self.first_steps.append(first_step)
        if self.on_train is not None:
            self.on_train(len(self.first_steps))
        return {"tokens": 64.0, "loss": 2.5, "steps": float(steps)}

    def delta(self):
        return distinct_delta(self.loaded[-1], len(self.first_steps))


def distinct_delta(weights: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """About 0.01 everywhere, each value 0.005 or 0.015 by a sign pattern drawn for `n`: the
    deltas of two n's point apart as honest replicas' do (about 0.6 between their directions),
    so that none is a near-copy of another (the replay screen refuses those)."""
    gen = torch.Generator().manual_seed(n)
    signs = {k: 2 * torch.randint(2, weights[k].shape, generator=gen) - 1 for k in sorted(weights)}
    return {k: (0.01 + 0.005 * signs[k]).to(v.dtype) for k, v in weights.items()}


def client_for(h: Harness, token: str, **kwargs) -> AggregatorClient:
    sleeps: list[float] = []
    kwargs.setdefault("sleep", sleeps.append)
    kwargs.setdefault("rng", random.Random(0))
    c = AggregatorClient("http://agg", token, client=h.client, **kwargs)
    c.sleeps = sleeps  # type: ignore[attr-defined]
    return c


@pytest.fixture
def h(tmp_path):
    harness = make_harness(tmp_path / "s", SETTINGS)
    yield harness
    harness.state.close()


def test_client_calls(h):
    c = client_for(h, h.alice)
    reg = c.register(block=1)
    assert reg.block == 1 and reg.local_steps == 3 and c.worker_id == reg.worker_id
    cfg = c.config()
    assert cfg["blocks"] == 2 and cfg["run_config"]["seed"] == 5
    assert cfg["tensors"]["1"]["layer.weight"] == [8, 4]
    pulled = c.pull(1)
    assert pulled.round == 0 and pulled.version == 0 and pulled.deadline_in == 30
    assert all(t.dtype == torch.float32 for t in pulled.tensors.values())
    delta = {k: torch.full_like(v, 0.01) for k, v in pulled.tensors.items()}
    res = c.push(1, delta, base_version=0, round=0, tokens=64, loss=2.0)
    assert res.accepted and res.body["update_id"] >= 1
    again = c.push(1, delta, base_version=0, round=0, tokens=64)
    assert not again.accepted and again.reason == "late" and again.status == 409
    assert c.round(1)["round"] == 1
    assert c.bytes_up == res.nbytes + again.nbytes and c.bytes_down > pulled.nbytes
    c.leave()
    with pytest.raises(Refused) as exc:
        c.pull(1)
    assert exc.value.reason == "unknown_worker"


def test_transient_failures_are_retried_with_backoff(h):
    failures = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if failures["n"] < 3:
            failures["n"] += 1
            raise httpx.ConnectError("connection refused", request=request)
        if failures["n"] == 3:
            failures["n"] += 1
            return httpx.Response(503, text="busy")
        r = h.client.request(
            request.method, str(request.url), headers=request.headers, content=request.content
        )
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    sleeps: list[float] = []
    c = AggregatorClient(
        "http://agg",
        h.alice,
        transport=httpx.MockTransport(handler),
        sleep=sleeps.append,
        rng=random.Random(1),
        retry=RetryPolicy(base_s=0.5, cap_s=1.5),
    )
    assert c.register().worker_id == 0
    assert len(sleeps) == 4, "three connection errors and one 503"
    assert all(0 <= s <= cap for s, cap in zip(sleeps, (0.5, 1.0, 1.5, 1.5), strict=True))


def test_refusals_are_not_retried(h):
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return httpx.Response(
            401, json={"accepted": False, "reason": "invalid_token", "detail": "no"}
        )

    c = AggregatorClient(
        "http://agg", "x", transport=httpx.MockTransport(handler), sleep=lambda s: None
    )
    with pytest.raises(Refused) as exc:
        c.register()
    assert exc.value.reason == "invalid_token" and exc.value.status == 401 and calls["n"] == 1


def test_unreachable_after_the_retry_budget():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    c = AggregatorClient(
        "http://agg",
        "x",
        transport=httpx.MockTransport(handler),
        sleep=sleep,
        clock=lambda: now[0],
        retry=RetryPolicy(base_s=1.0, cap_s=4.0, give_up_after_s=30.0),
        rng=random.Random(0),
    )
    with pytest.raises(
        Unreachable, match=r"GET http://agg/v1/status failed for \d+s \(ConnectError"
    ):
        c.status()
    assert 30.0 < now[0] <= 34.0, "it gave up on the first failure past the budget"


def test_loop_trains_until_the_block_is_done(h):
    trainer = FakeTrainer()
    c = client_for(h, h.alice)
    report = WorkerLoop(c, lambda reg, cfg: trainer, block=0).run()
    assert report.stopped_by == "done" and report.rounds == 4 and report.accepted == 4
    assert trainer.first_steps == [0, 3, 6, 9], "the LR step follows the version: version * H"
    assert h.service.blocks[0].rounds.version == 4
    assert report.bytes_up > 0 and report.bytes_down > 0


def test_a_worker_whose_block_is_done_leaves(h):
    """Issue 30: workers that exited at the end of a run stayed `live yes` in the status (they
    left without a goodbye, so they counted as live for the live window). A worker whose block
    is done now says goodbye, and the status lists it as left."""
    report = WorkerLoop(client_for(h, h.alice), lambda reg, cfg: FakeTrainer(), block=0).run()
    assert report.stopped_by == "done"
    (w,) = h.state.ledger.workers(active_only=False)
    assert w.left_at is not None, "the worker told the aggregator it left"
    (shown,) = h.client.get("/v1/status", headers=auth(h.alice)).json()["workers"]["list"]
    assert (shown["worker_id"], shown["live"]) == (w.id, False)


def test_a_round_that_commits_nothing_does_not_advance_the_schedule(h):
    """Finding "quorum stuffing": the learning-rate schedule followed the round (round x H),
    so every burned round advanced it. It follows the version the worker trained from: a round
    that committed nothing leaves the next one at the same step."""

    def miss(n: int) -> None:
        if n == 2:  # the second round's update arrives after its deadline: nothing commits
            h.clock.advance(SETTINGS.deadline_s + 1)

    trainer = FakeTrainer(on_train=miss)
    report = WorkerLoop(c := client_for(h, h.alice), lambda reg, cfg: trainer, block=0).run()
    assert c.worker_id is not None and report.refused == {"late": 1}
    assert report.stopped_by == "done" and report.accepted == 3
    assert h.service.blocks[0].rounds.version == 3
    assert trainer.first_steps == [0, 3, 3, 6], "rounds 1 and 2 both train from version 1"


def test_loop_reads_the_latest_versions_of_its_upstream_blocks(h):
    """route = features: each round the worker of block 1 reads block 0's latest committed
    version from its immutable URL, without a pull, and a version it holds is not fetched
    again."""
    service = h.service
    pusher = h.register(h.bob, block=0)["worker_id"]

    def commit_block0(rounds_done: int) -> None:
        if rounds_done == 2:  # between the worker's rounds 1 and 2, block 0 moves on
            view = service.blocks[0].rounds.view()
            body = delta_body(0, base_version=view.version, round=view.round, worker=pusher)
            assert h.push(h.bob, pusher, 0, body).status_code == 200
            h.clock.advance(31)  # past the deadline: the round closes with bob's update
            service.tick()

    trainer = FakeTrainer(on_train=commit_block0, upstream_blocks=[0])
    c = client_for(h, h.alice)
    report = WorkerLoop(c, lambda reg, cfg: trainer, block=1, max_rounds=3).run()
    assert report.rounds == 3
    versions = [service.blocks[0].rounds.version] * 3
    assert versions[0] == 1 and [sorted(u) for u in trainer.upstream] == [[0]] * 3
    first, second, third = (u[0] for u in trainer.upstream)
    assert all(torch.equal(first[k], second[k]) for k in first)  # version 0 twice
    assert any(not torch.equal(second[k], third[k]) for k in second)  # then version 1
    assert all(v.dtype == torch.float32 for v in third.values())
    assert (
        service.blocks[0].pulls_by_worker.get(report.worker_id, 0) == 0
        if hasattr(service.blocks[0], "pulls_by_worker")
        else True
    )


def test_loop_re_registers_when_its_worker_is_gone(h):
    c = client_for(h, h.alice)

    def kick(n: int) -> None:
        if n == 2:  # the operator removes the worker while it trains its second round
            h.client.delete(
                f"/v1/workers/{c.worker_id}",
                headers={"Authorization": f"Bearer {h.alice}", "X-Worker-Id": str(c.worker_id)},
            )

    trainer = FakeTrainer(on_train=kick)
    report = WorkerLoop(c, lambda reg, cfg: trainer, block=1).run()
    assert report.refused == {"unknown_worker": 1}
    assert report.stopped_by == "done" and report.worker_id == 1, "registered again"
    assert h.service.blocks[1].rounds.done


def test_loop_stops_cleanly_and_says_goodbye(h):
    stop = threading.Event()
    trainer = FakeTrainer(on_train=lambda n: stop.set() if n == 2 else None)
    c = client_for(h, h.alice)
    report = WorkerLoop(c, lambda reg, cfg: trainer, block=0, stop=stop).run()
    assert report.stopped_by == "signal" and report.rounds == 1
    (w,) = h.state.ledger.workers(active_only=False)
    assert w.left_at is not None, "the worker told the aggregator it left"


def test_loop_gives_up_on_a_revoked_token(h):
    c = client_for(h, h.alice)
    trainer = FakeTrainer(on_train=lambda n: h.state.ledger.revoke_token("alice", 1.0))
    with pytest.raises(Refused) as exc:
        WorkerLoop(c, lambda reg, cfg: trainer, block=0).run()
    assert exc.value.reason == "invalid_token", "a revoked token reads as an unknown one"


@pytest.mark.parametrize(("wire", "exact"), [("fp16", "on"), ("int8", "on"), ("int8", "off")])
def test_loop_comes_back_after_an_aggregator_restart(tmp_path, wire, exact):
    """The aggregator goes away mid-run and comes back on the same state folder: the worker's
    retries reconnect and it carries on from the restored round. With int8 the pulls are
    deltas: under exact pulls (the default) each version's commit, and the version the worker
    pulls after the restart was committed by the restarted aggregator, so every pull after the
    first is a delta. Without exact pulls they are deltas from the worker's view; the restarted
    aggregator holds no views, so the first pull after it is whole (unknown_base), and the ones
    after are deltas again."""
    h = make_harness(tmp_path / "s", SETTINGS.replace(delta_wire=wire, exact_pulls=exact))
    target = {"client": h.client, "down": 0}
    stop = threading.Event()
    paths: list[tuple[str, int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append((request.url.path, -1))
        if target["down"] > 0:
            target["down"] -= 1
            raise httpx.ConnectError("connection refused", request=request)
        r = target["client"].request(
            request.method,
            str(request.url),
            headers=request.headers,
            content=request.content,
            follow_redirects=False,  # a transport hands a 303 back, as httpx does
        )
        paths[-1] = (request.url.path, r.status_code)
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    def crash(n: int) -> None:
        if n == 2:  # kill and restart the aggregator while the worker trains
            h2 = h.reopen()
            target["client"] = h2.client
            target["down"] = 5
            target["h2"] = h2

    c = AggregatorClient(
        "http://agg",
        h.alice,
        transport=httpx.MockTransport(handler),
        sleep=lambda s: None,
        stop=stop,
    )
    report = WorkerLoop(c, lambda reg, cfg: FakeTrainer(on_train=crash), block=0).run()
    assert report.stopped_by == "done" and report.accepted == 4, report
    h2 = target["h2"]
    assert h2.service.blocks[0].rounds.version == 4
    assert all(u.committed_version is not None for u in h2.state.ledger.updates(fate="accepted"))
    deltas = [status for path, status in paths if path.endswith("/delta")]
    if wire == "int8" and exact == "on":
        assert deltas == [200, 200, 200], paths  # versions 1, 2 and 3
    elif wire == "int8":
        assert deltas.count(200) == 2 and deltas.count(404) == 1, paths  # versions 1, 3; 2
    else:
        assert deltas == []
    h2.state.close()


def test_loop_stops_after_max_rounds_and_leaves(h):
    c = client_for(h, h.alice)
    report = WorkerLoop(c, lambda reg, cfg: FakeTrainer(), block=1, max_rounds=2).run()
    assert report.stopped_by == "max_rounds" and report.rounds == 2
    assert h.service.blocks[1].rounds.assigned == set(), "it left: the block does not wait"


class Ticks:
    """2 s more at each reading, so that each round's training takes 2 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 2.0
        return self.now


def test_the_loop_says_a_line_per_round_and_a_hint_when_late(h):
    """Issue 30, "workers are silent": a worker's log stayed empty for minutes, then printed
    `12 rounds, 7 accepted, refused {'late': 5}`. Each round now says its steps, bytes/s, loss
    and verdict, and a late one says what to change, with the aggregator's flag names."""

    def miss(n: int) -> None:
        if n == 2:  # the second round's update arrives after its deadline
            h.clock.advance(SETTINGS.deadline_s + 1)

    lines: list[str] = []
    ticks = Ticks()
    loop = WorkerLoop(
        client_for(h, h.alice),
        lambda reg, cfg: FakeTrainer(on_train=miss),
        block=0,
        say=lines.append,
        clock=lambda: h.clock.now + ticks(),  # the aggregator's time, and 2 s a reading
    )
    report = loop.run()
    assert report.refused == {"late": 1} and report.late == 1
    assert lines[0] == "worker 0 on block 0 (data seed 5120, H = 3 local steps a round)"
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == report.rounds == 4
    # FakeTrainer trains 64 bytes in the 2 s between two readings of the clock
    assert rounds[0] == "round 0 (block 0): 3 steps in 2.0s, 32 bytes/s, loss 2.500; accepted"
    assert rounds[1] == (
        "round 1 (block 0): 3 steps in 33.0s, 2 bytes/s, loss 2.500; refused: late (round 1 "
        "has closed; the open round is 2 (staleness bound 0))"
    )
    (hint,) = [line for line in lines if "hint" in line]
    assert lines.index(hint) == lines.index(rounds[1]) + 1, "the hint follows its round"
    assert hint.startswith("  hint: updates arrive after the round's deadline (3 local steps")
    assert "took 33.0s, the push came 37.0s after the pull, the round had 30.0s left" in hint
    assert hint.endswith(
        "raise the aggregator's --deadline or lower its --local-steps, or run it with "
        "--set pacing=adaptive"
    )
    for flag in ("--deadline", "--local-steps"):  # as spelt
        assert any(s.flag == flag for _, s in declared())
    assert "pacing" in {f.name for f, _ in declared()}  # --set pacing=adaptive


def test_an_update_counted_late_says_so(h):
    """Within the staleness bound a late update is accepted into the open round at a lower
    weight: its line says so, with the same hint."""
    h2 = make_harness(h.state.root.parent / "s2", SETTINGS.replace(staleness=2))
    try:
        bob = h2.register(h2.bob, block=0)["worker_id"]

        def overtaken(n: int) -> None:
            if n == 2:  # round 1 closes with bob's update while this worker trains
                view = h2.service.blocks[0].rounds.view()
                h2.pull(h2.bob, bob, 0)
                body = delta_body(0, base_version=view.version, round=view.round, worker=bob)
                assert h2.push(h2.bob, bob, 0, body).status_code == 200
                h2.clock.advance(SETTINGS.deadline_s + 1)
                h2.service.tick()

        lines: list[str] = []
        ticks = Ticks()
        WorkerLoop(
            client_for(h2, h2.alice),
            lambda reg, cfg: FakeTrainer(on_train=overtaken),
            block=0,
            say=lines.append,
            clock=lambda: h2.clock.now + ticks(),
            max_rounds=2,
        ).run()
        late = next(line for line in lines if line.startswith("round 1 "))
        assert late.endswith("accepted late, in round 2 at weight 0.50"), lines
        assert any(line.startswith("  hint: updates arrive after") for line in lines)
    finally:
        h2.state.close()


def test_a_hint_tells_a_round_closed_early_from_a_missed_deadline():
    from blocktrain.protocol.worker.loop import RoundOutcome

    base = RoundOutcome(
        round=3, block=1, steps=10, seconds=12.0, tokens=2560, loss=2.0, accepted=False,
        reason="late", detail="round 3 has closed; the open round is 4 (staleness bound 0)",
        deadline_in=60.0, elapsed=13.0,
    )  # fmt: skip
    assert base.bytes_per_s == pytest.approx(2560 / 12)
    early = base.hint()
    assert early is not None and early.startswith("the round closed before its deadline")
    assert "--set grace_s or quorum" in early
    missed = dataclasses.replace(base, seconds=70.0, elapsed=71.0).hint()
    assert missed is not None and missed.startswith("updates arrive after the round's deadline")
    assert dataclasses.replace(base, accepted=True, reason="", detail="").hint() is None
    assert len(dataclasses.replace(base, reason="stale_version").lines()) == 1, "no hint"
