"""The worker obeys the steps its pull tells it (adaptive pacing, issue 30): a slow worker late
in its first round is told fewer steps, runs them, declares them, and gets in."""

from __future__ import annotations

import random

import torch

from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.loop import WorkerLoop
from tests.protocol.conftest import Harness, make_harness

ADAPTIVE = AggregatorSettings(
    deadline_s=30,
    local_steps=8,
    pacing="adaptive",
    max_delta_norm=50,
    max_tokens=10_000,
    max_rounds=4,
    min_round_s=0.0,
    replay_rounds=0,
    effect_probe="off",
)


class SlowTrainer:
    """5 s of the aggregator's clock a step; records the steps it is asked for."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.asked: list[tuple[int, int]] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.upstream_blocks: list[int] = []

    def load(self, weights):
        self.loaded = weights

    def load_upstream(self, blocks):
        pass

    def train(self, steps, first_step, should_stop):
        self.asked.append((steps, first_step))
        self.h.clock.advance(5.0 * steps)
        return {"tokens": 64.0, "loss": 2.5, "steps": float(steps)}

    def delta(self):
        value = 0.01 + 1e-3 * len(self.asked)
        return {k: torch.full_like(v, value) for k, v in self.loaded.items()}


def test_a_slow_worker_runs_the_steps_it_is_told_and_gets_in(tmp_path) -> None:
    h = make_harness(tmp_path / "s", ADAPTIVE)
    try:
        trainer = SlowTrainer(h)
        lines: list[str] = []
        client = AggregatorClient(
            "http://agg", h.alice, client=h.client, sleep=lambda s: None, rng=random.Random(0)
        )
        loop = WorkerLoop(
            client, lambda reg, cfg: trainer, block=0, say=lines.append, clock=h.clock
        )
        report = loop.run()
        # round 0: H = 8 steps, 40 s: late; then 0.8 x 30 / 5 = 4 steps, 20 s: in time
        assert [steps for steps, _ in trainer.asked] == [8, 4, 4, 4]
        # the schedule follows the version x H, whatever the steps
        assert [first for _, first in trainer.asked] == [0, 0, 8, 16]
        assert report.refused == {"late": 1} and report.accepted == 3
        assert report.local_steps == 8 + 3 * 4
        late = next(line for line in lines if "hint" in line)
        assert late.endswith("or lower its --set pacing_margin"), late
        assert any(line.startswith("round 1 (block 0): 4 steps") for line in lines), lines
        rows = [u for u in h.state.ledger.updates(fate="accepted")]
        assert len(rows) == 3
    finally:
        h.state.close()
