"""`bytes_summary`: a run's bytes against the minimum the protocol must move."""

from __future__ import annotations

from blocktrain.protocol.store.state import bytes_summary


def status(down: int, up: int, reported: dict[int, int]) -> dict:
    return {
        "bytes": {
            "by_endpoint": {
                "weights": {"bytes_out": down, "bytes_in": 0},
                "updates": {"bytes_out": 0, "bytes_in": up},
                "status": {"bytes_out": 10**9, "bytes_in": 0},  # monitoring: left out
            }
        },
        "participation": {str(b): [{"reported": n}] for b, n in reported.items()},
    }


def test_the_minimum_counts_a_features_worker_s_upstream_reads() -> None:
    """Under route = features a worker of block b reads blocks 0..b-1 each round: a run that
    moves exactly that is at the minimum, not 1.5x above it."""
    wire = {0: 100, 1: 100, 2: 100}
    pushed = {0: 50, 1: 50, 2: 50}
    # one worker a block, one round: pulls 3 x 100, reads (0 + 1 + 2) x 100, pushes 3 x 50
    run = status(down=300 + 300, up=150, reported={0: 1, 1: 1, 2: 1})
    features = bytes_summary(run, wire, pushed, reads_upstream=True)
    assert features["minimum"] == 750 and features["ratio_to_minimum"] == 1.0
    state = bytes_summary(run, wire, pushed)
    assert state["minimum"] == 450 and state["total"] == 750
