"""The aggregator's Prometheus metrics (text exposition format, version 0.0.4), read off a
status snapshot and the ledger's update counts."""

from __future__ import annotations

from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Samples = list[tuple[dict[str, Any], float]]


def exposition(snapshot: dict[str, Any], update_counts: list[dict[str, Any]]) -> str:
    """Every metric of docs/protocol.md, from `status.snapshot(...)` and
    `Ledger.update_counts()`."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: Samples) -> None:
        out.append(f"# HELP blocktrain_{name} {help_}")
        out.append(f"# TYPE blocktrain_{name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            out.append(
                f"blocktrain_{name}{{{text}}} {_num(value)}"
                if text
                else f"blocktrain_{name} {_num(value)}"
            )

    blocks = snapshot["blocks"]
    per_block = (
        ("block_version", "version", "Committed version of each block."),
        ("block_round", "round", "Open round of each block."),
        (
            "block_pending_updates",
            "pending_accepted",
            "Accepted updates waiting in the open round.",
        ),
        ("live_workers", "live_replicas", "Workers heard from within the live window."),
    )
    for name, key, help_ in per_block:
        metric(name, "gauge", help_, [({"block": b["block"]}, b[key]) for b in blocks])
    last = [(int(k), v[-1]) for k, v in snapshot["participation"].items() if v]
    metric(
        "round_participation",
        "gauge",
        "Participation of the last closed round (docs/protocol.md, Accounting).",
        [({"block": b}, r["participation"]) for b, r in last],
    )
    samples: Samples = [
        (
            {
                "block": "" if r["block"] is None else r["block"],
                "fate": r["fate"],
                "reason": r["reason"],
            },
            r["n"],
        )
        for r in update_counts
    ]
    metric("updates_total", "counter", "Updates by block, fate and reason.", samples)
    by_ep = snapshot["bytes"]["by_endpoint"]
    metric(
        "requests_total",
        "counter",
        "Requests by endpoint.",
        [({"endpoint": ep}, v["requests"]) for ep, v in sorted(by_ep.items())],
    )
    metric(
        "bytes_total",
        "counter",
        "Body bytes by endpoint and direction.",
        [
            ({"endpoint": ep, "direction": d}, v[f"bytes_{d}"])
            for ep, v in sorted(by_ep.items())
            for d in ("in", "out")
        ],
    )
    metric(
        "refused_requests_total",
        "counter",
        "Requests refused since the aggregator started, by endpoint and reason (ledger rows "
        "or not).",
        [
            ({"endpoint": ep, "reason": reason}, n)
            for ep, by_reason in sorted(snapshot.get("refused_requests", {}).items())
            for reason, n in sorted(by_reason.items())
        ],
    )
    metric(
        "uptime_seconds",
        "gauge",
        "Seconds since the aggregator started.",
        [({}, snapshot["uptime_s"])],
    )
    return "\n".join(out) + "\n"


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
