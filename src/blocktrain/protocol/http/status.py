"""What `/v1/status` shows: the open rounds of the blocks served here (and where the others
live), the workers, the participation of the last rounds, the updates by fate and the bytes
moved. Its cost does not grow with the ledger: the update counts are the ledger's counters, the
rounds the last few of each block, the traffic one row per (endpoint, block, worker)
(tests/protocol/service/test_access.py counts the rows read)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blocktrain.protocol.core.participation import participation

if TYPE_CHECKING:
    from blocktrain.protocol.service.aggregator_service import AggregatorService


def round_record(row: dict[str, Any]) -> dict[str, Any]:
    """A closed round as status shows it, from its ledger row."""
    return {
        "round": row["round"],
        "accepted": row["accepted"],
        "in_time": row["in_time"],
        "refused": row["refused"],
        "expected": row["expected"],
        "reported": row["reported"],
        "cause": row["cause"],
        "held": row["held"],  # why the rule committed no change, or None
        "version": row["new_version"],
        "participation": participation(row["in_time"], row["expected"]),
        "duration_s": None if row["started_at"] is None else row["closed_at"] - row["started_at"],
    }


MAX_STATUS_ROUNDS = 1000
"""The most closed rounds per block one snapshot lists in `participation` (`?rounds=N` above it
is served as this many): what one call may ask of the ledger, whatever the run's length."""


def snapshot(service: AggregatorService, *, last_rounds: int = 20) -> dict[str, Any]:
    """Everything /v1/status shows (no authentication: for the CLI and tests); `participation`
    lists the last `last_rounds` closed rounds of each block, at most MAX_STATUS_ROUNDS."""
    last_rounds = min(last_rounds, MAX_STATUS_ROUNDS)
    now = service.clock()
    with service.lock:
        engine = service.engine
        registry = engine.registry
        live = registry.live(now)
        entries = dict(registry.workers)
        blocks = []
        for b, st in service.blocks.items():
            r = st.rounds
            blocks.append(
                {
                    "block": b,
                    "round": r.round,
                    "version": r.version,
                    "deadline": r.deadline,
                    "deadline_in": None if r.deadline is None else r.deadline - now,
                    "done": r.done,
                    "expected": sorted(r.expected(now)),
                    "reported": sorted(r.reported),
                    "pending_accepted": len(r.accepted),
                    "assigned": sorted(r.assigned),
                    "live_replicas": sum(1 for blk in live.values() if blk == b),
                    "params": st.spec.n_params,
                    "wire_bytes": st.spec.wire_bytes,
                    "delta_bytes": st.spec.delta_bytes,
                    "pull_bytes": st.spec.pull_bytes(service.settings.pulls),
                    "probe_band": engine.bands[b].upper if b in engine.bands else None,
                }
            )
        reputation = {w: engine.reputation.of(registry.identity(w)) for w in registry.workers}
        live_identities = registry.live_per_block(now)
        per_block = [live_identities[b] for b in service.blocks]
    ledger = service.ledger
    counts = ledger.worker_counts()
    names = {row.id: row.name for row in ledger.workers(active_only=False)}
    workers = [
        {
            "worker_id": w,
            "name": names.get(w),  # its --name, None without one
            "block": e.block,
            "live": w in live,
            "last_seen_s": now - e.last_seen,
            "accepted": counts.get(w, {}).get("accepted", 0),
            "refused": counts.get(w, {}).get("refused", 0),
            "reputation": reputation[w],
        }
        for w, e in sorted(entries.items())
    ]
    by_reason: dict[str, int] = {}
    accepted_total = refused_total = 0
    for row in ledger.update_counts():
        if row["fate"] == "accepted":
            accepted_total += row["n"]
        else:
            refused_total += row["n"]
            by_reason[row["reason"]] = by_reason.get(row["reason"], 0) + row["n"]
    part: dict[str, list[dict[str, Any]]] = {}
    for b in service.blocks:
        for row in ledger.rounds(b, last=last_rounds):
            part.setdefault(str(b), []).append(round_record(row))
    return {
        "time": now,
        "uptime_s": now - service.started_at,
        "blocks": blocks,
        "versions": [b["version"] for b in blocks],
        "rounds": [b["round"] for b in blocks],
        "done": all(b["done"] for b in blocks),
        "served": list(service.directory.served),
        "peers": {str(b): url for b, url in sorted(service.directory.peers.items())},
        "workers": {
            "registered": len(entries),
            "live": len(live),
            "per_block": per_block,
            "list": workers,
        },
        "participation": part,
        "updates": {
            "accepted": accepted_total,
            "refused": refused_total,
            "refused_by_reason": by_reason,
        },
        "bytes": service.traffic.summary(),
        "settings": service.public_settings(),
        "refused_requests": service.traffic.refusals(),
    }
