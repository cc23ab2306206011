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

MAX_LEFT_WORKERS = 100
"""The most workers that left one snapshot lists (the last to leave): a long run's churn of
restarted workers does not grow the answer (`workers.left` counts them all)."""

WORKER_STATES = ("live", "timed_out", "left")
"""A worker in the status: `live` (heard from within the live window), `timed_out` (registered,
not heard from within it: stopped, or slow), `left` (it said goodbye, DELETE /v1/workers/{id},
as a worker does when stopped or when its block is done; or it was retired for a newer worker of
its token, or its token revoked)."""


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
                    "influence_reference": st.influence.size,
                }
            )
        reputation = {w: engine.reputation.of(registry.identity(w)) for w in registry.workers}
        drift = {
            w: engine.drift.score(e.block, registry.identity(w))
            for w, e in registry.workers.items()
        }
        live_identities = registry.live_per_block(now)
        per_block = [live_identities[b] for b in service.blocks]
    ledger = service.ledger
    counts = ledger.worker_counts()
    rows = ledger.workers(active_only=False)  # after the registry: every entry has its row
    names = {r.id: r.name for r in rows}
    left_rows = [r for r in rows if r.left_at is not None and r.id not in entries]
    with service.lock:
        for gone in left_rows:  # its token's standing: one identity per token, Registry.identity
            reputation[gone.id] = engine.reputation.of(("token", gone.token_id))

    def worker(
        w: int, block: int, state: str, last_seen: float, left_at: float | None
    ) -> dict[str, Any]:
        return {
            "worker_id": w,
            "name": names.get(w),  # its --name, None without one
            "block": block,
            "live": state == "live",
            "state": state,
            "last_seen_s": now - last_seen,
            "left_s": None if left_at is None else now - left_at,
            "accepted": counts.get(w, {}).get("accepted", 0),
            "refused": counts.get(w, {}).get("refused", 0),
            "reputation": reputation[w],
            "drift": drift.get(w),  # its identity's drift score on its block; None: not observed
        }

    shown_left = sorted(left_rows, key=lambda r: (r.left_at or 0.0, r.id))[-MAX_LEFT_WORKERS:]
    workers = sorted(
        [
            worker(w, e.block, "live" if w in live else "timed_out", e.last_seen, None)
            for w, e in entries.items()
        ]
        + [worker(r.id, r.block, "left", r.last_seen, r.left_at) for r in shown_left],
        key=lambda entry: entry["worker_id"],
    )
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
        "done": all(b["done"] for b in blocks),  # every block served here
        "served": list(service.directory.served),
        "peers": {str(b): url for b, url in sorted(service.directory.peers.items())},
        "workers": {
            "registered": len(entries),
            "live": len(live),
            "left": len(left_rows),
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
        "codecs": service.settings.codecs(service.run_config),
        "refused_requests": service.traffic.refusals(),
    }
