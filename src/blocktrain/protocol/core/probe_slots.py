"""The effect probe's places, for the round engine: each identity's probe budget per round of a
block (`probe_budget`) and the bounded queue before the probe (`PROBE_SLOTS`). `RoundEngine`
takes it as a mixin; it reads the engine's settings, registry and blocks' rounds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from blocktrain.protocol.core.effect import ProbeCache
from blocktrain.protocol.core.events import EngineBlock, ProbeSlot
from blocktrain.protocol.core.registry import Registry
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import Verdict

PROBE_SLOTS = 8
"""Updates that may hold a place at the effect probe at once (probing or waiting for it), over
every identity; beyond them a push is refused `busy` (429) before its body waits. Each holds
its body in memory, so this bounds what the probe's queue costs."""


class ProbeSlots:
    """`reserve_probe` and `release_probe` over the engine's state (declared here, set by
    `RoundEngine`)."""

    settings: AggregatorSettings
    blocks: dict[int, EngineBlock]
    registry: Registry
    probe: ProbeCache | None
    _probe_spent: dict[int, tuple[int, Counter[Hashable]]]
    probing: int

    def reserve_probe(self, worker: int, block: int) -> tuple[Verdict, ProbeSlot | None]:
        """A place at the effect probe for an update of `worker` that passed the cheap checks:
        refused `busy` when its identity holds or spent `probe_budget` places in the block's open round
        (a refused update keeps its place spent), or when PROBE_SLOTS updates hold one. Give it back
        with `release_probe`. No slot when the probe is off."""
        if self.probe is None:
            return Verdict.ok(), None
        spent_out = self.budget_spent(worker, block)
        if spent_out is not None:
            return spent_out, None
        identity = self.registry.identity(worker)
        open_round = self.blocks[block].rounds.round
        spent_round, spent = self._probe_spent.get(block, (open_round, Counter()))
        if spent_round != open_round:
            spent = Counter()
        if self.probing >= PROBE_SLOTS:
            return Verdict.refuse(
                "busy", f"the effect probe's queue is full ({PROBE_SLOTS} updates); retry"
            ), None
        spent[identity] += 1
        self._probe_spent[block] = (open_round, spent)
        self.probing += 1
        return Verdict.ok(), ProbeSlot(block, open_round, identity)

    def budget_spent(self, worker: int, block: int) -> Verdict | None:
        """`busy` when `worker`'s identity holds or spent its `probe_budget` places in the block's
        open round (None otherwise): a driver may refuse a push before reading its body."""
        if self.probe is None:
            return None
        identity = self.registry.identity(worker)
        open_round = self.blocks[block].rounds.round
        spent_round, spent = self._probe_spent.get(block, (open_round, Counter()))
        held = spent[identity] if spent_round == open_round else 0
        budget = self.settings.probe_budget
        if held < budget:
            return None
        return Verdict.refuse(
            "busy",
            f"this identity's updates reached the effect probe {held} time(s) in round "
            f"{open_round} of block {block} without being accepted (probe_budget {budget}); "
            "wait for the next round",
        )

    def release_probe(self, slot: ProbeSlot | None, accepted: bool) -> None:
        """The probe is done with an update: its place is free again, and returned to its
        identity's budget if the update was accepted."""
        if slot is None:
            return
        self.probing = max(0, self.probing - 1)
        spent_round, spent = self._probe_spent.get(slot.block, (-1, Counter()))
        if accepted and spent_round == slot.round and spent[slot.identity] > 0:
            spent[slot.identity] -= 1
