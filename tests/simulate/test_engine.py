"""The simulator end to end on a micro model: real local training, virtual time."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import load_split
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.simulate import (
    REGIMES,
    Dist,
    Regime,
    SimSpec,
    Simulation,
    TimingOnlyTrainer,
    simulate,
    write_outputs,
)
from blocktrain.training import Trainer
from blocktrain.training.costs import worker_costs
from blocktrain.training.profiles import PROFILES
from tests.conftest import micro_config

ROUNDS = 4


def spec(cfg: RunConfig | None = None, **kw: object) -> SimSpec:
    cfg = cfg or apply_overrides(micro_config(), [f"steps={ROUNDS * 2}"])
    args: dict = {"seed": cfg.seed, "eval_bytes": 256, "final_bytes": 512, **kw}
    return SimSpec(cfg, 6, ROUNDS, {"local_steps": 2}, **args)


def run(corpus: Path, regimes: list[Regime], **kw: object):
    return simulate(spec(**kw), regimes, load_split(corpus, "train"), load_split(corpus, "valid"))


def test_same_seed_gives_bitwise_the_same_records_and_weights(corpus: Path) -> None:
    regimes = [REGIMES["lockstep"], REGIMES["wan"]]
    first, w1 = run(corpus, regimes)
    second, w2 = run(corpus, regimes)
    for name in ("lockstep", "wan"):
        assert first["regimes"][name]["rounds"] == second["regimes"][name]["rounds"]
        assert first["regimes"][name]["updates"] == second["regimes"][name]["updates"]
        for b in w1[name]:
            for k, v in w1[name][b].items():
                assert torch.equal(v, w2[name][b][k]), (name, b, k)
    # and a different seed gives a different run
    other, _ = run(corpus, [REGIMES["wan"]], seed=99)
    assert other["regimes"]["wan"]["rounds"] != first["regimes"]["wan"]["rounds"]


def test_lockstep_trains_every_update_and_lowers_the_ce(corpus: Path) -> None:
    report, weights = run(corpus, [REGIMES["lockstep"]])
    result = report["regimes"]["lockstep"]
    assert result["participation"] == 1.0
    assert result["updates"]["refused"] == {} and result["updates"]["dropped"] == 0
    assert result["updates"]["accepted"] == 6 * ROUNDS
    assert [r["round"] for r in result["rounds"]] == list(range(ROUNDS))
    for record in result["rounds"]:
        assert {b["cause"] for b in record["blocks"]} == {"all_reported"}
        assert [b["version"] for b in record["blocks"]] == [record["round"] + 1] * 3
    assert result["final_ce"] < result["initial_ce"]
    assert result["final_sampler_ce"] < result["initial_ce"]
    assert result["initial_ce"] == pytest.approx(5.545, abs=0.01)  # zero heads: uniform bytes
    assert sorted(weights["lockstep"]) == [0, 1, 2]
    # every worker trained H steps a round
    assert all(w["local_steps"] == 2 * ROUNDS for w in result["workers"])


def test_virtual_time_advances_by_events_not_by_sleeping(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    test_thread, real_sleep = threading.current_thread(), time.sleep

    def no_sleep(seconds: float) -> None:
        if threading.current_thread() is not test_thread:  # another test's daemon (malloc-trim)
            return real_sleep(seconds)
        raise AssertionError(f"the simulation slept {seconds}s")

    monkeypatch.setattr(time, "sleep", no_sleep)
    # a device a million times slower than this one, 5 s away: minutes of virtual time a round
    snail = dataclasses.replace(
        PROFILES["cpu"], name="snail", peak_flops_per_s=PROFILES["cpu"].peak_flops_per_s / 1e6
    )
    snail = dataclasses.replace(snail, latency_s=5.0)
    slow = Regime("slow", step_s=Dist.const(60.0), latency_s=Dist.const(5.0))
    report, _ = run(corpus, [slow], profile=snail)
    virtual = report["regimes"]["slow"]["virtual_time_s"]
    step = min(c["step_s"] for c in report["costs"])
    assert step > 60, "a step of the micro block takes minutes on the snail"
    assert virtual >= ROUNDS * (2 * step + 2 * 5.0)
    times = [r["time"] for r in report["regimes"]["slow"]["rounds"]]
    assert times == sorted(times)


def test_dropouts_and_deadlines_are_recorded_with_reasons(corpus: Path) -> None:
    flaky = Regime(
        "flaky",
        step_s=Dist.lognormal(1.0, 0.6),
        latency_s=Dist.const(0.1),
        dropout=0.3,
        deadline=1.0,
    )
    report, _ = run(corpus, [flaky])
    result = report["regimes"]["flaky"]
    assert result["updates"]["dropped"] > 0
    assert result["updates"]["refused"].get("late", 0) > 0
    assert 0 < result["participation"] < 1
    causes = {b["cause"] for r in result["rounds"] for b in r["blocks"]}
    assert "deadline" in causes
    late = sum(b["refused"].get("late", 0) for r in result["rounds"] for b in r["blocks"])
    done = result["updates"]["refused"].get("done", 0)
    assert late + done == sum(result["updates"]["refused"].values())
    expected = sum(b["expected"] for r in result["rounds"] for b in r["blocks"])
    assert expected == result["updates"]["expected"]


def test_eval_every_and_deadline_override(corpus: Path) -> None:
    s = replace(spec(eval_every=3), protocol={"local_steps": 2, "deadline_s": 123.0})
    report, _ = simulate(
        s, [REGIMES["mild"]], load_split(corpus, "train"), load_split(corpus, "valid")
    )
    result = report["regimes"]["mild"]
    assert result["deadline_s"] == 123.0
    ces = [r["from_noise_ce"] for r in result["rounds"]]
    assert [c is not None for c in ces] == [False, False, True, True]  # round 3, and the last
    assert result["final_ce"] == ces[-1]


def test_outputs_are_written(corpus: Path, tmp_path: Path) -> None:
    report, weights = run(corpus, [REGIMES["lockstep"], REGIMES["mild"]])
    paths = write_outputs(tmp_path / "out", report, weights)
    names = {p.relative_to(tmp_path / "out").as_posix() for p in paths}
    assert names == {
        "simulate.json",
        "ce.png",
        "lockstep/rounds.jsonl",
        "lockstep/weights.safetensors",
        "mild/rounds.jsonl",
        "mild/weights.safetensors",
    }
    assert (tmp_path / "out" / "ce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "out" / "mild" / "rounds.jsonl").read_text().splitlines()
    assert len(lines) == ROUNDS


def test_too_few_workers_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="without a replica"):
        SimSpec(micro_config(), 2, 3, {})
    with pytest.raises(ConfigError, match="rounds"):
        SimSpec(micro_config(), 6, 0, {})


@pytest.mark.parametrize("wire", ["int8", "topk:0.1", "sparse:0.05:4"])
def test_compressed_deltas_train(corpus: Path, wire: str) -> None:
    """End to end: pushes in int8, top-k or sparse (error feedback on each virtual worker) are
    accepted, pushes and pulls move fewer bytes than fp16, and the CE goes down."""
    compressed = replace(spec(), protocol={"local_steps": 2, "delta_wire": wire})
    train, valid = load_split(corpus, "train"), load_split(corpus, "valid")
    report, _ = simulate(compressed, [REGIMES["lockstep"]], train, valid)
    result = report["regimes"]["lockstep"]
    assert result["updates"]["accepted"] == 6 * ROUNDS, result["updates"]
    assert result["final_sampler_ce"] < result["initial_ce"] - 0.05
    dense, _ = run(corpus, [REGIMES["lockstep"]])
    assert result["bytes"]["up"] < 0.6 * dense["regimes"]["lockstep"]["bytes"]["up"]
    # pulls: each worker's first reads whole (its own block and, under route = features, the
    # blocks before it), then deltas in the push codec (the default pull_wire), upstream too
    dense_down = dense["regimes"]["lockstep"]["bytes"]["down"]
    assert 0 < result["bytes"]["down"] < 0.75 * dense_down  # upstream read whole: ~0.8 at int8


def test_a_reference_unit_alone_is_the_reference_trained_in_one_process(
    corpus: Path, tmp_path: Path
) -> None:
    """DiLoCo's replica (`--set unit=reference`): one worker, plain averaging and an fp32 wire
    make its rounds exactly `train --reference` (same batches, steps and AdamW state)."""
    cfg = apply_overrides(micro_config(), [f"steps={ROUNDS * 2}"])
    protocol = {"local_steps": 2, "effect_probe": "off", "wire_dtype": "fp32"}
    one = SimSpec(cfg, 1, ROUNDS, protocol, seed=cfg.seed, eval_bytes=256, unit="reference")
    assert one.cfg.model.blocks == 1  # the reference has no blocks
    train, valid = load_split(corpus, "train"), load_split(corpus, "valid")
    report, weights = simulate(one, [REGIMES["lockstep"]], train, valid)
    result = report["regimes"]["lockstep"]
    assert report["unit"] == "reference" and result["updates"]["accepted"] == ROUNDS
    assert result["final_ce"] < result["initial_ce"]
    trainer = Trainer.create(one.cfg, tmp_path / "ref", train, None, kind="reference")
    trainer.run(progress=False)
    assert trainer.reference is not None
    for name, value in trainer.reference.state_dict().items():
        torch.testing.assert_close(weights["lockstep"][0][name], value, atol=1e-5, rtol=1e-4)
    with pytest.raises(ConfigError, match="--set unit=reference simulates with --effect-probe off"):
        simulate(replace(one, protocol={"local_steps": 2}), [REGIMES["lockstep"]], train, valid)


class MissingTrainer(TimingOnlyTrainer):
    """Zero deltas, except a NaN one (refused) in its second round; records each round's
    first step."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(shapes, tokens_per_step=8)
        self.first_steps: list[int] = []

    def train(self, steps, first_step, should_stop=lambda: False):
        self.first_steps.append(first_step)
        return super().train(steps, first_step, should_stop)

    def delta(self):
        if len(self.first_steps) == 2:
            return {k: torch.full_like(v, float("nan")) for k, v in self.zeros.items()}
        return self.zeros


def test_the_schedule_follows_committed_versions_as_a_worker_s_does() -> None:
    """As `protocol.worker.loop.WorkerLoop` (tests/protocol/worker/test_worker.py): a virtual worker trains
    from step version x H, so a round that commits nothing (every update refused) does not
    advance the learning-rate schedule; it used to be round x H."""
    initial = {0: {"w": torch.zeros(4, 4), "b": torch.zeros(4)}}
    settings = AggregatorSettings(local_steps=2, max_rounds=4, max_delta_norm=10.0)
    trainers: list[MissingTrainer] = []

    def make(_worker: int, _block: int) -> MissingTrainer:
        trainers.append(MissingTrainer({k: tuple(v.shape) for k, v in initial[0].items()}))
        return trainers[-1]

    cost = worker_costs(micro_config(), local_steps=2)[0]  # any unit's: it sets the deadline
    sim = Simulation(
        REGIMES["lockstep"], settings, initial, make, 2, seed=0, costs={0: cost},
        profile=PROFILES["cpu"],
    )  # fmt: skip
    sim.run()
    causes = [sim.closed[(0, r)].cause for r in range(4)]
    assert causes[1] == "deadline", "round 1's updates were all refused: it ran to its deadline"
    assert sim.agg.blocks[0].rounds.version == 3
    assert [t.first_steps for t in trainers] == [[0, 2, 2, 4]] * 2


def test_a_relay_run_moves_streams_down_the_chain_and_trains_every_block(corpus: Path) -> None:
    """route = relay: block b's workers train on the streams block b-1's relayed a round before
    (so block b's round r waits for block b-1's round r), and the bytes say so."""
    cfg = apply_overrides(micro_config(), [f"steps={ROUNDS * 2}", "route=relay"])
    report, _ = run(corpus, [REGIMES["lockstep"]], cfg=cfg)
    result = report["regimes"]["lockstep"]
    assert result["participation"] == 1.0
    assert result["updates"]["accepted"] == 6 * ROUNDS, "every replica, every round"
    assert all(w["local_steps"] == 2 * ROUNDS for w in result["workers"])
    for record in result["rounds"]:
        closes = [b["closed_at"] for b in record["blocks"]]
        assert closes == sorted(closes), "a block's round closes after the one before's"
    step = 4 * 16 * (32 + 5)  # N T (d + 5)
    streams = result["bytes"]
    # two replicas each of blocks 0 and 1 relay a stream of H = 2 steps a round; blocks 1 and 2
    # take one each (headers aside)
    assert 4 * ROUNDS * 2 * step <= streams["stream_up"] < 4 * ROUNDS * (2 * step + 1024)
    assert streams["stream_down"] == streams["stream_up"]
    assert result["final_sampler_ce"] < result["initial_ce"]
    timing, _ = simulate(spec(cfg=cfg, timing_only=True), [REGIMES["lockstep"]], None, None)
    assert timing["regimes"]["lockstep"]["bytes"]["stream_up"] == streams["stream_up"], (
        "a timing study moves the streams' true sizes"
    )
