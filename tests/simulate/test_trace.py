"""One trace, two consumers: the simulator's in-memory aggregator and the real
`AggregatorService` (its ledger, storage and all, on a fake clock) must take the same decision
at every step: the same pull views, the same verdict for every update, the same rounds closed at
the same times for the same cause, and bitwise the same weights."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blocktrain.errors import Refused
from blocktrain.protocol.rounds import RoundClosed
from blocktrain.protocol.service import open_service
from blocktrain.protocol.storage import StateDir
from blocktrain.simulate import SimAggregator
from tests.protocol.conftest import SETTINGS, T0, FakeClock, add_token, block_tensors, delta_body

Event = tuple[str, float, int, dict]


def make_trace(seed: int, workers: int, blocks: int, steps: int) -> list[Event]:
    """Random pulls, pushes (on time, late, stale, future, duplicated, malformed) and ticks.
    Push rounds and versions are chosen relative to what the worker last pulled, as a real
    worker's would be, plus deliberate mistakes."""
    rng = random.Random(seed)
    t = T0
    events: list[Event] = [("register", t, w, {}) for w in range(workers)]
    for _ in range(steps):
        t += rng.choice([0.0, 0.5, 3.0, 9.0, 17.0, 31.0])
        kind = rng.choices(["pull", "push", "tick"], weights=[4, 5, 1])[0]
        w = rng.randrange(workers)
        if kind == "push":
            events.append(
                (
                    "push",
                    t,
                    w,
                    {
                        "round_shift": rng.choices([0, -1, -2, 1], weights=[8, 2, 1, 1])[0],
                        "version_shift": rng.choices([0, -1, 1], weights=[10, 1, 1])[0],
                        "flaw": rng.choices(["", "nan", "huge", "tokens"], weights=[20, 1, 1, 1])[
                            0
                        ],
                        "scale": rng.uniform(-0.05, 0.05),
                        "tokens": rng.randint(50, 400),
                    },
                )
            )
        else:
            events.append((kind, t, w, {}))
    return events


def body_for(block: int, view: tuple[int, int], params: dict) -> bytes:
    round_, version = view
    tensors = {
        k: torch.full_like(v, params["scale"]) for k, v in block_tensors(100 + block).items()
    }
    if params["flaw"] == "nan":
        tensors["embed"][0, 0] = float("nan")
    if params["flaw"] == "huge":
        tensors["embed"] += 1e3
    tokens = 10**9 if params["flaw"] == "tokens" else params["tokens"]
    return delta_body(
        block,
        base_version=max(0, version + params["version_shift"]),
        round=max(0, round_ + params["round_shift"]),
        tokens=tokens,
        tensors=tensors,
    )


def replay(trace: list[Event], root: Path, settings) -> tuple[list, list, list]:
    """Feed the trace to both; returns (service decisions, simulator decisions, closes)."""
    state = StateDir.create(
        root,
        run_config={"seed": 5},
        settings=settings,
        blocks={b: block_tensors(100 + b) for b in range(2)},
    )
    token = add_token(state, "w")
    clock = FakeClock()
    service = open_service(state, clock=clock)
    sim = SimAggregator({b: block_tensors(100 + b) for b in range(2)}, settings)
    sim_closes: list[RoundClosed] = []
    sim.on_close.append(lambda closed, _weights: sim_closes.append(closed))
    auth = f"Bearer {token}"
    block_of: dict[int, int] = {}
    last_view: dict[int, tuple[int, int]] = {}
    got_service, got_sim = [], []
    for kind, t, w, params in trace:
        clock.now = t
        if kind == "register":
            reg = service.register(authorization=auth)
            worker, block = sim.register(t)
            assert (reg["worker_id"], reg["block"]) == (worker, block) == (w, reg["block"])
            block_of[w] = block
            last_view[w] = (reg["round"], reg["version"])
            continue
        b = block_of[w]
        if kind == "tick":
            service.tick()
            sim.tick(t)
        elif kind == "pull":
            try:
                pulled = service.pull(authorization=auth, worker_header=str(w), block=b)
                view = pulled.view
                got_service.append(("pull", view.round, view.version, view.deadline))
            except Refused as exc:
                got_service.append(("pull", exc.reason))
            sim_view, weights = sim.pull(w, b, t)
            if weights is None:
                got_sim.append(("pull", "done"))
            else:
                got_sim.append(("pull", sim_view.round, sim_view.version, sim_view.deadline))
                last_view[w] = (sim_view.round, sim_view.version)
        else:
            body = body_for(b, last_view[w], params)
            try:
                ctx = service.begin_push(
                    authorization=auth, worker_header=str(w), block=b, content_length=len(body)
                )
                res = service.submit(ctx, body)
                got_service.append(("push", True, "", res["weight"], res["counts_in"]))
            except Refused as exc:
                got_service.append(("push", False, exc.reason, None, None))
            judged = sim.push(w, b, body, t)
            v = judged.verdict
            got_sim.append(
                (
                    "push",
                    v.accepted,
                    v.reason,
                    v.weight if v.accepted else None,
                    v.counts_in if v.accepted else None,
                )
            )
    ledger_closes = [
        (r["block"], r["round"], r["base_version"], r["new_version"], r["cause"], r["closed_at"])
        for r in service.ledger.rounds()
    ]
    ledger_closes += [
        ("counts", r["block"], r["round"], r["accepted"], r["expected"], r["reported"])
        for r in service.ledger.rounds()
    ]
    sim_rows = sorted(sim_closes, key=lambda c: (c.block, c.round))
    closes_sim = [
        (c.block, c.round, c.base_version, c.new_version, c.cause, c.closed_at) for c in sim_rows
    ] + [
        ("counts", c.block, c.round, len(c.accepted), len(c.expected), len(c.reported))
        for c in sim_rows
    ]
    for b in range(2):
        for name, value in service.blocks[b].weights.items():
            assert torch.equal(value, sim.weights(b)[name]), (b, name)
    state.close()
    return got_service, got_sim, [ledger_closes, closes_sim]


@pytest.mark.parametrize(
    "seed, settings",
    [
        (0, replace(SETTINGS, max_rounds=8)),
        (1, replace(SETTINGS, max_rounds=8, staleness=1, stale_weight=0.5)),
        (2, replace(SETTINGS, max_rounds=5, outer_momentum=0.9, outer_lr=0.7, rule="median")),
    ],
)
def test_simulator_and_aggregator_decide_alike(tmp_path: Path, seed: int, settings) -> None:
    trace = make_trace(seed, workers=5, blocks=2, steps=220)
    got_service, got_sim, (closes_service, closes_sim) = replay(trace, tmp_path / "s", settings)
    assert got_service == got_sim
    assert closes_service == closes_sim
    # the trace exercised what it is meant to exercise
    reasons = {d[2] for d in got_sim if d[0] == "push"}
    assert {"", "late", "stale_version"} <= reasons
    assert any(d[0] == "push" and d[1] for d in got_sim)
    causes = {c[4] for c in closes_sim if c[0] != "counts"}
    assert causes == {"deadline", "all_reported"}
    assert len(closes_sim) >= 8
