"""`Attack`: which hostile workers a simulation adds (`blocktrain simulate --set attack=...`,
bench/adversarial.py); the kinds are described in `simulate/attacks/__init__.py`."""

from __future__ import annotations

from dataclasses import dataclass

from blocktrain.errors import ConfigError

FORGED = ("shrink", "bias", "noise")  # from the pulled weights alone (`forge`)
POISONED = ("poison_repeat", "poison_shuffle", "poison_foreign")  # the wrong bytes (`poison`)
PROBED = ("drift", "ascend")  # sized against their own copy of the effect probe (`probed`)
ECHOES = ("copy", "replay")  # an honest worker's delta pushed again (`echoes`)
KINDS = FORGED + POISONED + PROBED + ECHOES


@dataclass(frozen=True)
class Attack:
    """Who attacks, and how."""

    kind: str
    count: int = 1
    block: int | None = None
    shared_token: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"attack {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.count <= 0:
            raise ConfigError(f"attack {self.kind}: count must be positive")

    @staticmethod
    def parse(text: str) -> Attack:
        """`KIND[:COUNT[:BLOCK]][:shared]`, e.g. `shrink`, `noise:4:0`, `shrink:4:shared`."""
        parts = [p.strip() for p in text.split(":")]
        shared = parts[-1] == "shared"
        if shared:
            parts = parts[:-1]
        if not parts or len(parts) > 3:
            raise ConfigError(f"--set attack={text}: expected KIND[:COUNT[:BLOCK]][:shared]")
        try:
            numbers = [int(p) for p in parts[1:]]
        except ValueError:
            raise ConfigError(f"--set attack={text}: COUNT and BLOCK are integers") from None
        count = numbers[0] if numbers else 1
        block = numbers[1] if len(numbers) > 1 else None
        return Attack(parts[0], count, block, shared)

    @property
    def trains(self) -> bool:
        """Whether its workers run real training steps (they need the run's data)."""
        return self.kind in POISONED + PROBED

    def token(self, i: int) -> int:
        """The identity attacker i speaks for (distinct from every honest worker's)."""
        return -1 if self.shared_token else -1 - i
