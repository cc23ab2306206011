"""Persistence of the round engine's events. The simulator and the service drive the same
`protocol.core.round_engine.RoundEngine`, so their decisions cannot differ; what the service adds
is the ledger and the state folder. Replayed with a random trace (on time, late, stale, future,
duplicated and malformed updates, ticks), every commit the engine makes must be in the ledger
and on disk, and a service restarted halfway must resume the same round state and weights."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blocktrain.errors import Refused
from blocktrain.protocol.core.events import Committed
from blocktrain.protocol.service.aggregator_service import AggregatorService, open_service
from blocktrain.protocol.store.storage import StateDir
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


TRACE = replace(SETTINGS, max_workers_per_token=8)
"""The trace's five workers share one token."""


def round_state(service: AggregatorService, *, restored: bool = False) -> list[tuple]:
    """What a restart must restore of each block's open round. A restored round counts every
    assigned worker as having pulled (pull marks are written in batches and a crash can lose
    them), so `restored` states the pulls as the assigned workers."""
    return [
        (
            b,
            r.round,
            r.version,
            r.started_at,
            sorted(r.assigned),
            sorted(r.assigned if restored else r.pulled),
            sorted(r.reported),
            sorted(r.prev_reported),
            [(c.update_id, c.worker_id, c.tokens, c.weight, c.round) for c in r.accepted],
            r.refused,
        )
        for b, r in ((b, st.rounds) for b, st in service.blocks.items())
    ]


def replay(trace: list[Event], root: Path, settings, restarts: set[int]) -> dict:
    """Feed the trace to the service, restarting it (same folder, same clock) before each
    event in `restarts`; returns what the checks need."""
    state = StateDir.create(
        root,
        run_config={"seed": 5},
        settings=settings,
        blocks={b: block_tensors(100 + b) for b in range(2)},
    )
    token = add_token(state, "w")
    clock = FakeClock()
    service = open_service(state, clock=clock)
    commits: list[Committed] = []
    service.engine.on_commit.append(commits.append)
    auth = f"Bearer {token}"
    block_of: dict[int, int] = {}
    last_view: dict[int, tuple[int, int]] = {}
    reasons: set[str] = set()
    resumed = 0  # restarts that had an open round to resume
    for i, (kind, t, w, params) in enumerate(trace):
        clock.now = t
        if i in restarts:
            service.tick()  # the ticker flushes the batched pull marks, as while serving
            before = round_state(service, restored=True)
            weights = {b: dict(st.weights) for b, st in service.blocks.items()}
            state.close()
            state = StateDir(root)
            service = open_service(state, clock=clock)
            service.engine.on_commit.append(commits.append)
            resumed += any(st.rounds.pulled or st.rounds.accepted for st in service.blocks.values())
            assert round_state(service) == before, "the restart resumed another round state"
            for b, st in service.blocks.items():
                for name, value in st.weights.items():
                    # the same fp32 tensors written and read back: exact
                    assert torch.equal(value, weights[b][name]), (b, name)
        if kind == "register":
            reg = service.register(token=service.authenticate(auth, address=None))
            block_of[w] = reg["block"]
            last_view[w] = (reg["round"], reg["version"])
            continue
        b = block_of[w]
        if kind == "tick":
            service.tick()
        elif kind == "pull":
            try:
                token = service.authenticate(auth, address=None)
                pulled = service.pull(caller=service.identify(token, str(w)), block=b)
                last_view[w] = (pulled.view.round, pulled.view.version)
            except Refused as exc:
                reasons.add(exc.reason)
        else:
            body = body_for(b, last_view[w], params)
            try:
                token = service.authenticate(auth, address=None)
                ctx = service.begin_push(token=token, worker_header=str(w), block=b)
                service.submit(ctx, body)
                reasons.add("")
            except Refused as exc:
                reasons.add(exc.reason)
    rows = service.ledger.rounds()
    on_disk = {b: state.load_tensors(b, st.rounds.version) for b, st in service.blocks.items()}
    memory = {b: dict(st.weights) for b, st in service.blocks.items()}
    state.close()
    return {
        "commits": commits,
        "rows": rows,
        "on_disk": on_disk,
        "memory": memory,
        "reasons": reasons,
        "resumed": resumed,
    }


@pytest.mark.parametrize(
    "seed, settings",
    [
        (0, replace(TRACE, max_rounds=8, keep_versions=0)),
        (1, replace(TRACE, max_rounds=8, staleness=1, stale_weight=0.5, keep_versions=0)),
        (2, replace(TRACE, max_rounds=5, outer_momentum=0.9, outer_lr=0.7, rule="median")),
    ],
)
def test_every_commit_is_in_the_ledger_and_on_disk(tmp_path: Path, seed: int, settings) -> None:
    trace = make_trace(seed, workers=5, blocks=2, steps=220)
    # Restarts from event 12 on: one right after the registrations would make round 0 wait
    # for every worker (a restored round expects them all), and seed 2 would then close no
    # round as "all_reported", which the last checks want exercised.
    got = replay(trace, tmp_path / "s", settings, restarts=set(range(12, len(trace), 7)))
    commits: list[Committed] = got["commits"]
    assert [
        (r["block"], r["round"], r["base_version"], r["new_version"], r["cause"], r["closed_at"])
        for r in got["rows"]
    ] == sorted(
        (
            c.closed.block,
            c.closed.round,
            c.closed.base_version,
            c.closed.new_version,
            c.closed.cause,
            c.closed.closed_at,
        )
        for c in commits
    ), "the ledger holds exactly the engine's commits"
    by_key = {(c.closed.block, c.closed.round): c.closed for c in commits}
    for r in got["rows"]:
        closed = by_key[(r["block"], r["round"])]
        assert (r["accepted"], r["expected"], r["reported"], r["refused"]) == (
            len(closed.accepted),
            len(closed.expected),
            len(closed.reported),
            closed.refused,
        )
        assert r["in_time"] == sum(1 for c in closed.accepted if c.round == closed.round)
    for b, weights in got["memory"].items():
        for name, value in weights.items():
            # the committed version file holds the served weights: same tensors, no arithmetic
            assert torch.equal(got["on_disk"][b][name], value), (b, name)
    # the trace exercised what it is meant to exercise
    assert {"", "late", "stale_version"} <= got["reasons"]
    assert {c.closed.cause for c in commits} == {"deadline", "all_reported"}
    assert len(commits) >= 8
    assert got["resumed"] >= 2, "the restarts resumed open rounds"
