"""Hostile workers in the simulator: forged deltas at the bound, every kind in a short run, and
what the defaults do. Each kind's own behaviour: tests/simulate/attacks/."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.simulate import REGIMES, SimSpec, simulate
from blocktrain.simulate.attacks import KINDS, Attack, ForgingTrainer
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


def test_attack_specs_parse_and_refuse_nonsense():
    assert Attack.parse("shrink") == Attack("shrink")
    assert Attack.parse("noise:4:0") == Attack("noise", 4, 0)
    assert Attack.parse("shrink:4:shared") == Attack("shrink", 4, None, True)
    assert Attack("shrink", 4, shared_token=True).token(3) == -1
    assert len({Attack("shrink", 4).token(i) for i in range(4)}) == 4
    for bad in ("mystery", "shrink:x", "shrink:0", "shrink:1:2:3"):
        with pytest.raises(ConfigError):
            Attack.parse(bad)
    for kind in KINDS:
        assert Attack.parse(f"{kind}:2:1") == Attack(kind, 2, 1), kind
    assert Attack.parse("drift:4:2") == Attack("drift", 4, 2)


def test_attacks_that_train_refuse_a_run_that_does_not() -> None:
    for kind in ("poison_repeat", "drift", "ascend"):
        with pytest.raises(ConfigError, match="timing-only"):
            SimSpec(CFG, 6, 2, {}, timing_only=True, attack=Attack(kind))
    SimSpec(CFG, 6, 2, {}, timing_only=True, attack=Attack("copy"))  # echoes need no data


CFG = apply_overrides(micro_config(), [f"steps={ROUNDS * 2}"])


def run(corpus: Path, attack: Attack | None, protocol: dict, rounds: int = ROUNDS):
    cfg = CFG
    spec = SimSpec(
        cfg,
        6,
        rounds,
        {"local_steps": 2, **protocol},
        seed=cfg.seed,
        eval_bytes=256,
        final_bytes=512,
        final_sweeps=2,
        eval_every=rounds,
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


NEW_KINDS = [k for k in KINDS if k not in ("shrink", "bias", "noise")]


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_every_kind_runs_its_workers_on_its_block(corpus: Path, kind: str) -> None:
    """Two attackers of each kind on block 2, two rounds: every push of theirs is judged, and
    the run's records and final weights come out."""
    result, weights = run(corpus, Attack(kind, 2, block=2), {}, rounds=2)
    attackers = [w for w in result["workers"] if w["attacker"]]
    assert [w["block"] for w in attackers] == [2, 2]
    for w in attackers:
        assert w["accepted"] + sum(w["refused"].values()) == 2, (kind, w)
        fates = Counter(p["fate"] for p in w["pushes"])
        assert fates == Counter({"accepted": w["accepted"], **w["refused"]}), (kind, w)
        assert sorted(p["round"] for p in w["pushes"]) == [0, 1], (kind, w)
    assert all("pushes" not in w for w in result["workers"] if not w["attacker"])
    if kind == "ascend":  # what its trainer reported of each push comes with it
        assert all(0.0 <= p["ascent_share"] <= 1.0 for w in attackers for p in w["pushes"])
    assert len(result["rounds"]) == 2 and result["final_sampler_ce"] is not None
    assert all(torch.isfinite(v).all() for v in weights[2].values()), kind


def test_a_patient_attacker_is_refused_for_drift_and_the_honest_workers_are_not(
    corpus: Path,
) -> None:
    """`--set attack=drift`: 0.9 x a real delta plus a lean on one coordinate that its copy of the
    probe passes, every round, beside three honest workers of its block; every update passes
    its round's checks, and the lean is flagged (docs/protocol.md, Drift)."""
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
