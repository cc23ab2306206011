"""The replay screen of the round engine: an update is bound to its worker, round and base
version, and its tensors are new. `RoundEngine` takes it as a mixin; it reads the engine's
registry, its blocks' rounds, each worker's last pull (`pulled`) and the digests of recent
bodies (`seen`), which the engine prunes when a round commits.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from blocktrain.protocol.core.events import Checked, EngineBlock
from blocktrain.protocol.core.rounds import NOT_A_REPORT, Registry
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import Verdict

REPLAY_ENTRIES = 4096
"""At most this many digests per block (the oldest go first): the set stays bounded."""


@dataclass
class Seen:
    """A body's tensors as the engine saw them pushed: by whom first, in which round of the
    block, and whether any push of them was accepted."""

    identity: Hashable
    round: int
    accepted: bool


class ReplayScreen:
    """`screen` and `_remember` over the engine's state (declared here, set by `RoundEngine`)."""

    settings: AggregatorSettings
    blocks: dict[int, EngineBlock]
    registry: Registry
    seen: dict[int, dict[bytes, Seen]]
    pulled: dict[int, tuple[int, int, int]]

    def screen(self, worker: int, block: int, checked: Checked) -> Verdict:
        """The replay verdict on an update that passed `inspect` and `judge`: it is bound to
        its worker, round and base version, and its tensors are new. Refused `replay` when its
        metadata names another worker than the one pushing it, or another round or version
        than that worker's last pull of the block (when this engine saw one), or when the same
        tensors (`Candidate.digest`) were accepted before, or pushed by another identity, in
        the last `replay_rounds` rounds of any block. Read-only; `record` remembers the
        tensors."""
        meta, candidate = checked.meta, checked.candidate
        assert meta is not None and candidate is not None
        if meta.worker_id is not None and meta.worker_id != worker:
            return Verdict.refuse(
                "replay", f"the body names worker {meta.worker_id}; worker {worker} pushed it"
            )
        pulled = self.pulled.get(worker)
        if (
            pulled is not None
            and pulled[0] == block
            and pulled[1:]
            != (
                meta.round,
                meta.base_version,
            )
        ):
            return Verdict.refuse(
                "replay",
                f"the body names round {meta.round} from version {meta.base_version}; worker "
                f"{worker} last pulled round {pulled[1]} (version {pulled[2]})",
            )
        digest = candidate.digest
        if digest is None:
            return Verdict.ok()
        identity = self.registry.identity(worker)
        for b, seen in self.seen.items():  # every block: blocks of one shape swap bodies
            entry = seen.get(digest)
            if entry is None:
                continue
            where = f"round {entry.round} of block {b}"
            if entry.accepted:
                return Verdict.refuse("replay", f"the same tensors were accepted in {where}")
            if entry.identity != identity:
                return Verdict.refuse(
                    "replay", f"the same tensors were pushed by another identity in {where}"
                )
        return Verdict.ok()

    def _remember(self, block: int, checked: Checked, identity: Hashable, verdict: Verdict) -> None:
        """Keep the digest of a pushed body's tensors (one that was judged: not a replay, and
        not refused before its round was), for `screen`."""
        digest = None if checked.candidate is None else checked.candidate.digest
        if digest is None or verdict.reason in NOT_A_REPORT or verdict.reason == "replay":
            return
        if not self.settings.replay_rounds:
            return
        seen = self.seen.setdefault(block, {})
        entry = seen.get(digest)
        if entry is None:
            seen[digest] = Seen(identity, self.blocks[block].rounds.round, verdict.accepted)
            while len(seen) > REPLAY_ENTRIES:
                del seen[next(iter(seen))]
        elif verdict.accepted:
            entry.accepted = True
