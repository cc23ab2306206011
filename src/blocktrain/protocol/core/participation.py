"""The accounting of rounds (docs/protocol.md, Accounting): which of a closed round's accepted
updates were its own, and its participation, as `/v1/status`, the history and the simulator
report it.
"""

from __future__ import annotations

from blocktrain.protocol.core.rounds import RoundClosed


def in_time(closed: RoundClosed) -> int:
    """Accepted updates of the round itself (not those counted in it late, from an earlier
    round)."""
    return sum(1 for c in closed.accepted if c.round == closed.round)


def participation(in_time: int, expected: int) -> float:
    """Updates of the round itself accepted, over the replicas it expected (of one round, or of
    several summed); updates counted late are the previous round's participation, come too late. A
    round that expected nobody has participation 1 if it accepted an update of its own, else 0."""
    return in_time / expected if expected else float(in_time > 0)
