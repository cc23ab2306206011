"""bench/adversarial.py's reading of its rows, without a simulation: each row keyed by its
preset, defences and rounds, and read against the clean row of the same three."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from blocktrain.simulate.attacks import KINDS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import adversarial


def row(
    attack: str, defences: str, ce: float, preset: str | None = None, rounds: int = 20
) -> dict[str, Any]:
    return {
        **({} if preset is None else {"preset": preset}),  # None: a row from before --preset
        "attack": attack,
        "defences": defences,
        "final_ce": ce,
        "clean_ce": None,
        "seed": 0,
        "rounds": rounds,
        "local_steps": 10,
        "attacker_accepted": 0,
        "attacker_refused": {},
        "honest_refused": {},
        "rounds_held": 0,
        "max_delta_norm": 1.0,
    }


def test_rows_are_read_against_the_clean_row_of_their_preset() -> None:
    rows = [row("clean", "default", 2.0), row("noise", "default", 2.1)]  # tiny, before --preset
    rows += [row("noise", "default", 1.9, "small"), row("clean", "default", 1.7, "small")]
    result = adversarial.result_of({adversarial.key_of(r): r for r in rows})
    got = [(r["preset"], r["attack"], r["clean_ce"]) for r in result["rows"]]
    assert got == [
        ("tiny", "clean", 2.0),
        ("tiny", "noise", 2.0),
        ("small", "clean", 1.7),
        ("small", "noise", 1.7),
    ]
    text = adversarial.markdown(result)
    assert "| small | noise | default | 20 | 1.900 | 1.700 | +0.200 |" in text
    assert result["rows"][3]["final_ce"] - result["rows"][3]["clean_ce"] == pytest.approx(0.2)


def test_a_row_is_read_against_the_clean_row_of_its_length() -> None:
    """The drift rows run at least MIN_ROUNDS: a shorter clean row is not their reference."""
    rows = [row("clean", "default", 2.0, "tiny", 10), row("clean", "default", 1.8, "tiny", 20)]
    rows += [row("drift", "default", 2.3, "tiny", 20), row("noise", "default", 2.1, "tiny", 10)]
    rows[1]["target_drift"], rows[2]["target_drift"] = -3.0, 4.5
    result = adversarial.result_of({adversarial.key_of(r): r for r in rows})
    got = {
        (r["attack"], r["rounds"]): (r["clean_ce"], r["clean_target_drift"]) for r in result["rows"]
    }
    assert got[("drift", 20)] == (1.8, -3.0)
    assert got[("noise", 10)] == (2.0, None), "a clean row from before target_drift has none"
    assert "| +4.50 (-3.00) |" in adversarial.markdown(result)
    args = argparse.Namespace(rounds=10)
    assert adversarial.rounds_of("drift", args) == adversarial.MIN_ROUNDS["drift"] >= 20
    assert adversarial.rounds_of("noise", args) == 10
    assert adversarial.rounds_of("drift_four", argparse.Namespace(rounds=30)) == 30


def test_target_drift_is_byte_0_s_logit_bias_less_the_others_mean() -> None:
    bias = torch.tensor([5.0, 1.0, 2.0, 3.0])
    assert adversarial.target_drift({"head.bias": bias, "other": torch.ones(3)}) == 3.0


def test_every_row_names_a_kind_the_simulator_knows() -> None:
    assert {a.kind for a in adversarial.ATTACKS.values() if a is not None} <= set(KINDS)


def test_the_clean_rows_updates_are_listed_per_round() -> None:
    clean = {**row("clean", "default", 2.0, "small"), "per_round": []}
    clean["per_round"] = [
        {"accepted": 6, "refused": {}},
        {"accepted": 4, "refused": {"no_gain": 1, "harmful": 1}},
    ]
    text = adversarial.markdown(adversarial.result_of({adversarial.key_of(clean): clean}))
    assert "- small default, 20 rounds: 6/0 4/2" in text


def test_honest_updates_refused_by_the_replay_screen_are_counted() -> None:
    """Issue 58's bar: no honest update is refused `replay` or `copy` (a false positive of
    the near-copy screen); rows from before the count show none."""
    counted = {**row("clean", "default", 2.0, "tiny", 10), "honest_screened": 0}
    old = row("noise", "default", 2.1, "tiny", 10)
    result = adversarial.result_of({adversarial.key_of(r): r for r in (counted, old)})
    lines = adversarial.markdown(result).splitlines()
    assert "honest refused replay or copy" in lines[2]
    assert "| none | 0 | 0 |" in lines[4] and "| none | — | 0 |" in lines[5]
