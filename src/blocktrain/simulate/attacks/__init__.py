"""Hostile workers for the simulator (`blocktrain simulate --set attack=...`; docs/simulate.md,
"Attackers", describes each kind; BENCHMARKS.md, "Poisoning"): forged deltas (`forge.py`),
honest training on the wrong bytes (`poison.py`), deltas sized against the attacker's own copy of
the effect probe (`probed.py`) and echoes of honest deltas (`echoes.py`), built by `Hostiles`."""

from blocktrain.simulate.attacks.forge import ForgingTrainer
from blocktrain.simulate.attacks.hostiles import Hostiles
from blocktrain.simulate.attacks.spec import KINDS, Attack

__all__ = ["KINDS", "Attack", "ForgingTrainer", "Hostiles"]
