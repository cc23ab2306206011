"""Fixtures for the protocol tests: a virtual clock, a small state folder, an in-process app."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.config import RunConfig
from blocktrain.protocol.core.bodies import encode
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.store.state import create_state
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.training.local import initial_blocks

T0 = 1_000_000.0


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def block_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(8, 4, generator=gen),
        "layer.bias": torch.randn(8, generator=gen),
        "embed": torch.randn(5, 4, generator=gen),
    }


SETTINGS = AggregatorSettings(
    deadline_s=30.0,
    local_steps=2,
    max_delta_norm=50.0,
    max_tokens=10_000,
    n_workers=16,
    quorum=1.0,  # rounds wait for every live replica up to the deadline, unless a test says so
    min_round_s=0.0,  # and close as soon as they may (test_rounds.py tests the minimum)
    replay_rounds=0,  # the synthetic deltas repeat (test_trust_rounds.py tests replays)
)


def make_state(
    root: Path, settings: AggregatorSettings = SETTINGS, blocks: int = 2, seed: int = 5
) -> StateDir:
    return StateDir.create(
        root,
        run_config={"seed": seed, "note": "synthetic"},
        settings=settings,
        blocks={b: block_tensors(100 + b) for b in range(blocks)},
    )


def add_token(state: StateDir, name: str, blocks: tuple[int, ...] | list[int] = ()) -> str:
    token = new_token()
    state.ledger.add_token(name, hash_token(token), T0, blocks=blocks)
    return token


def auth(token: str, worker: int | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    if worker is not None:
        headers["X-Worker-Id"] = str(worker)
    return headers


def delta_body(
    block: int,
    *,
    base_version: int = 0,
    round: int = 0,
    tokens: int = 100,
    scale: float = 0.01,
    dtype: str = "fp16",
    worker: int | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    **extra_meta: object,
) -> bytes:
    tensors = (
        tensors
        if tensors is not None
        else {k: torch.full_like(v, scale) for k, v in block_tensors(100 + block).items()}
    )
    meta: dict[str, object] = {
        "block": block,
        "base_version": base_version,
        "round": round,
        "tokens": tokens,
        **extra_meta,
    }
    if worker is not None:
        meta["worker_id"] = worker
    return encode(tensors, meta, dtype)


@dataclass
class Harness:
    """An aggregator app in this process, with a virtual clock and two tokens."""

    state: StateDir
    clock: FakeClock
    client: TestClient
    alice: str
    bob: str

    @property
    def service(self):  # the app's AggregatorService
        return self.client.app.state.service  # type: ignore[attr-defined]

    def register(self, token: str, block: int | None = None) -> dict:
        body = {} if block is None else {"block": block}
        r = self.client.post("/v1/workers", json=body, headers=auth(token))
        assert r.status_code == 200, r.text
        return r.json()

    def pull(self, token: str, worker: int, block: int):
        return self.client.get(f"/v1/blocks/{block}", headers=auth(token, worker))

    def push(
        self,
        token: str,
        worker: int,
        block: int,
        body: bytes,
        headers: dict[str, str] | None = None,
    ):
        return self.client.post(
            f"/v1/blocks/{block}/updates",
            content=body,
            headers={**auth(token, worker), **(headers or {})},
        )

    def weights(self, block: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.service.blocks[block].weights.items()}

    def reopen(self) -> Harness:
        """A fresh app on the same state folder, as after a crash and restart."""
        self.state.close()
        state = StateDir(self.state.root)
        app = create_app(storage=state, clock=self.clock)
        return Harness(
            state, self.clock, TestClient(app, base_url="http://agg"), self.alice, self.bob
        )


def make_harness(root: Path, settings: AggregatorSettings = SETTINGS) -> Harness:
    state = make_state(root, settings)
    alice, bob = add_token(state, "alice"), add_token(state, "bob")
    clock = FakeClock()
    app = create_app(storage=state, clock=clock)
    return Harness(state, clock, TestClient(app, base_url="http://agg"), alice, bob)


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    h = make_harness(tmp_path / "state")
    yield h
    h.state.close()


def run_state(root: Path, cfg: RunConfig, overrides: dict[str, Any]) -> StateDir:
    """A state folder for a real run of `cfg` (version 0 as a worker builds it)."""
    return create_state(root, cfg, overrides, initial_blocks(cfg))
