"""Hostile workers in the simulator: forged deltas at the bound, and what the defaults do."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.simulate import REGIMES, SimSpec, simulate
from blocktrain.simulate.attacks import DRIFT_BIAS, Attack, DriftingTrainer, ForgingTrainer
from tests.conftest import micro_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from defences import undefended  # bench/defences.py: the aggregator before the defences

ROUNDS = 4


def norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in tensors.values()))


def test_forged_deltas_sit_at_the_bound_and_claim_the_most_tokens():
    weights = {"a": torch.randn(8, 4), "b": torch.randn(3)}
    for kind in ("shrink", "bias", "noise"):
        t = ForgingTrainer(kind, bound=2.0, tokens=999, seed=1)
        t.load(weights)
        assert t.train(10, 20)["tokens"] == 999
        assert norm(t.delta()) == pytest.approx(0.99 * 2.0, rel=1e-5), kind
    bias = ForgingTrainer("bias", 2.0, 1, 0)
    bias.load(weights)
    assert int((bias.delta()["a"] != 0).sum() + (bias.delta()["b"] != 0).sum()) == 1
    bias.load({**weights, "head.bias": torch.zeros(5)})
    assert float(bias.delta()["head.bias"][0]) == pytest.approx(1.98), "a byte's logit"
    loose = ForgingTrainer("shrink", 1e6, 1, 0)
    loose.load(weights)
    assert torch.allclose(loose.delta()["a"], -1.76 * weights["a"]), "the -0.76x flip"


class FixedTrainer:
    """A trainer whose delta is given."""

    def __init__(self, delta: dict[str, torch.Tensor]) -> None:
        self.upstream_blocks: list[int] = []
        self._delta = delta

    def delta(self) -> dict[str, torch.Tensor]:
        return self._delta


def test_the_drift_attacker_sends_a_leaning_copy_of_its_real_delta():
    honest = {"head.bias": torch.randn(5), "w": torch.randn(8, 4)}
    sent = DriftingTrainer(FixedTrainer(honest)).delta()  # type: ignore[arg-type]
    assert torch.allclose(sent["w"], 0.9 * honest["w"])
    assert torch.allclose(sent["head.bias"][1:], 0.9 * honest["head.bias"][1:])
    lean = float(sent["head.bias"][0] - 0.9 * honest["head.bias"][0])
    assert lean == pytest.approx(DRIFT_BIAS * norm(honest), rel=1e-5)


def test_attack_specs_parse_and_refuse_nonsense():
    assert Attack.parse("shrink") == Attack("shrink")
    assert Attack.parse("noise:4:0") == Attack("noise", 4, 0)
    assert Attack.parse("shrink:4:shared") == Attack("shrink", 4, None, True)
    assert Attack("shrink", 4, shared_token=True).token(3) == -1
    assert len({Attack("shrink", 4).token(i) for i in range(4)}) == 4
    for bad in ("mystery", "shrink:x", "shrink:0", "shrink:1:2:3"):
        with pytest.raises(ConfigError):
            Attack.parse(bad)


CFG = apply_overrides(micro_config(), [f"steps={ROUNDS * 2}"])


def run(corpus: Path, attack: Attack | None, protocol: dict):
    cfg = CFG
    spec = SimSpec(
        cfg,
        6,
        ROUNDS,
        {"local_steps": 2, **protocol},
        seed=cfg.seed,
        eval_bytes=256,
        final_bytes=512,
        final_sweeps=2,
        eval_every=ROUNDS,
        attack=attack,
    )
    report, weights = simulate(
        spec, [REGIMES["lockstep"]], load_split(corpus, "train"), load_split(corpus, "valid")
    )
    return report["regimes"]["lockstep"], weights["lockstep"]


def test_sybils_on_one_block_cannot_wreck_it_under_the_defaults(corpus: Path) -> None:
    """Finding (Poisoning): one accepted update turned block 0 into -0.76x its weights, and
    Sybils outvoted honest workers. Four Sybils shrinking block 0 at the bound: without the
    defences the block collapses; with them it stays where the honest workers take it."""
    sybils = Attack("shrink", 4, block=0, shared_token=True)
    _, clean = run(corpus, None, {})
    attacked, defended = run(corpus, sybils, {})
    _, wrecked = run(corpus, sybils, undefended(CFG, 2))
    ref = norm(clean[0])
    assert abs(norm(defended[0]) - ref) < 0.1 * ref
    assert norm(wrecked[0]) < 0.5 * ref, "what the defences bought"
    attackers = [w for w in attacked["workers"] if w["attacker"]]
    assert len(attackers) == 4 and {w["block"] for w in attackers} == {0}


def test_a_patient_attacker_is_refused_for_drift_and_the_honest_workers_are_not(
    corpus: Path,
) -> None:
    """`--attack drift`: 0.9 x a real delta plus a 3 % lean on one coordinate, every round,
    beside three honest workers of its block; every update passes its round's checks, and the
    lean is flagged (docs/protocol.md, Drift)."""
    rounds = 25
    cfg = apply_overrides(micro_config(), [f"steps={rounds * 2}"])
    spec = SimSpec(
        cfg,
        9,
        rounds,
        {"local_steps": 2, "effect_probe": "off"},
        seed=cfg.seed,
        eval_bytes=256,
        final_bytes=256,
        final_sweeps=1,
        eval_every=rounds,
        attack=Attack("drift", 1, block=0),
    )
    report, _ = simulate(
        spec, [REGIMES["lockstep"]], load_split(corpus, "train"), load_split(corpus, "valid")
    )
    workers = report["regimes"]["lockstep"]["workers"]
    (evil,) = [w for w in workers if w["attacker"]]
    assert evil["refused"].get("drift", 0) >= AggregatorSettings().drift_min_rounds, evil
    assert all(w["refused"] == {} for w in workers if not w["attacker"]), workers
