"""`blocktrain status`: what an aggregator is doing: blocks, versions, rounds, participation,
workers (live, timed out, or left) and bytes moved; `run done` once every block has finished its
rounds."""

from __future__ import annotations

import argparse
from typing import Any

from blocktrain.cli.common import (
    Formatter,
    add_ca_arg,
    add_token_args,
    checked_ca,
    print_json,
    resolve_token,
)
from blocktrain.errors import ConfigError
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.retrying import RetryPolicy
from blocktrain.serving.shared.transport import check_url

EXAMPLES = """examples:
  blocktrain status http://127.0.0.1:8470 --token-file token.txt
  BLOCKTRAIN_TOKEN=bt_... blocktrain status https://agg.example:8470 --ca-file cert.pem --json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show an aggregator's progress",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("url", metavar="URL", help="the aggregator's URL")
    add_token_args(p, "token (any valid one)")
    add_ca_arg(p)
    p.add_argument("--rounds", type=int, default=5, help="recent rounds to show per block")
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="give up when the aggregator has not answered for S seconds",
    )
    p.add_argument("--json", action="store_true", help="print the full status JSON")
    p.set_defaults(handler=run)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _liveness(w: dict[str, Any]) -> str:
    state = w.get("state", "live" if w["live"] else "timed_out")
    if state == "left":
        return f"left {w['left_s']:.0f}s ago"
    if state == "timed_out":
        return f"not live (timed out, last seen {w['last_seen_s']:.0f}s ago)"
    return "live"


def render(s: dict[str, Any], rounds: int) -> str:
    done = ""
    if s["done"]:
        n = s["settings"]["max_rounds"]
        done = f"; run done (every block finished its {n} round{'' if n == 1 else 's'})"
    left = s["workers"].get("left", 0)
    lines = [
        f"uptime {s['uptime_s']:.0f}s; workers {s['workers']['live']} live of "
        f"{s['workers']['registered']} registered{f', {left} left' if left else ''}; updates "
        f"{s['updates']['accepted']} accepted, {s['updates']['refused']} refused{done}"
    ]
    for b in s["blocks"]:
        deadline = "" if b["deadline_in"] is None else f", deadline in {b['deadline_in']:.1f}s"
        lines.append(
            f"  block {b['block']}: round {b['round']}, version {b['version']}, "
            f"{b['live_replicas']} live, {len(b['reported'])}/{len(b['expected'])} "
            f"reported{deadline}{' (done)' if b['done'] else ''}"
        )
        for r in s["participation"].get(str(b["block"]), [])[-rounds:]:
            lines.append(
                f"    round {r['round']}: {r['accepted']} accepted, {r['refused']} "
                f"refused, {r['reported']}/{r['expected']} reported, participation "
                f"{r['participation']:.0%}, closed by {r['cause']}"
            )
    for w in s["workers"]["list"]:
        lines.append(
            f"  worker {w['worker_id']} {w.get('name') or '-'}: block {w['block']}, "
            f"{_liveness(w)}, {w['accepted']} accepted, "
            f"{w['refused']} refused"
        )
    by_reason = s["updates"]["refused_by_reason"]
    if by_reason:
        lines.append("  refusals: " + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())))
    bts = s["bytes"]
    lines.append(
        f"  bytes moved {_mb(bts['total'])} (in {_mb(bts['bytes_in'])}, out "
        f"{_mb(bts['bytes_out'])})"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_url(args.url, "URL")  # a typo is one line, not a traceback
    if args.rounds <= 0 or args.timeout <= 0:
        raise ConfigError("--rounds and --timeout must be positive")
    token = resolve_token(args)
    verify = checked_ca(args)
    client = AggregatorClient(
        args.url,
        token,
        verify=verify,
        retry=RetryPolicy(base_s=0.2, cap_s=1.0, give_up_after_s=args.timeout),
    )
    try:
        s = client._json("GET", "/v1/status", params={"rounds": args.rounds})
    finally:
        client.close()
    if args.json:
        print_json(s)
    else:
        print(render(s, args.rounds))
    return 0
