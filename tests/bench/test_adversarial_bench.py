"""bench/adversarial.py's reading of its rows, without a simulation: each row keyed by its
preset and read against the clean row of its preset and defences."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import adversarial


def row(attack: str, defences: str, ce: float, preset: str | None = None) -> dict[str, Any]:
    return {
        **({} if preset is None else {"preset": preset}),  # None: a row from before --preset
        "attack": attack,
        "defences": defences,
        "final_ce": ce,
        "clean_ce": None,
        "seed": 0,
        "rounds": 20,
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
    assert "| small | noise | default | 1.900 | 1.700 | +0.200 |" in text
    assert result["rows"][3]["final_ce"] - result["rows"][3]["clean_ce"] == pytest.approx(0.2)
