"""`Hostiles`: the trainers of one `Attack`'s workers in one simulation."""

from __future__ import annotations

from blocktrain.protocol.core.local_trainer import LocalTrainer
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.simulate.attacks.forge import ForgingTrainer
from blocktrain.simulate.attacks.spec import Attack


class Hostiles:
    """What a `Simulation` needs of its attackers: attacker i's trainer (`trainer`)."""

    def __init__(self, attack: Attack, settings: AggregatorSettings, *, seed: int) -> None:
        self.attack = attack
        self.settings = settings
        self.seed = seed

    def trainer(self, i: int, worker: int, block: int) -> LocalTrainer:
        """Attacker i's trainer; `worker`: its id."""
        settings = self.settings
        return ForgingTrainer(
            self.attack.kind, settings.max_delta_norm, settings.max_tokens, self.seed + i
        )
