"""Multi-host on one machine: runs the network-namespace test (tests/protocol/ops/test_netns.py:
an aggregator and two worker hosts in their own namespaces, veth links on a bridge, a delay of
20 ms and 1% loss on every link) and records what it measured, in docs/research/decentralised.md
(superseded by bench/wan_run.py's run). Needs root.

    python bench/protocol_netns.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from report import RESEARCH, ROOT, machine, update_section, write_json  # bench/report.py

COMMAND = "python -m pytest tests/protocol/ops/test_netns.py -m network -s"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "netns.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "tests/protocol/ops/test_netns.py",
                "-m",
                "network",
                "-s",
                "-q",
            ],
            cwd=ROOT,
            env={**os.environ, "BLOCKTRAIN_NETNS_RESULT": str(out)},
        )
        if done.returncode != 0 or not out.exists():
            sys.exit(f"the netns test did not pass (exit {done.returncode}); nothing written")
        result = json.loads(out.read_text())
    result["machine"] = machine()
    write_json("protocol_netns.json", result)
    rtt = sorted(result["connect_ms"])[len(result["connect_ms"]) // 2]
    by_ep = result["bytes_by_endpoint"]
    rows = "\n".join(
        f"| {ep} | {v['requests']} | {v['bytes_in']:,} | {v['bytes_out']:,} |"
        for ep, v in sorted(by_ep.items())
    )
    rounds = ", ".join(
        f"block {b}: "
        + " ".join(
            f"r{r['round']} {r['accepted']}/{r['expected']} ({r['duration_s']:.1f}s)" for r in rs
        )
        for b, rs in result["rounds"].items()
    )
    update_section(
        "protocol-netns",
        f"""
### Multi-host on one machine: network namespaces, delay and loss

Command: `{COMMAND}` (or `python bench/protocol_netns.py`, which writes
`benchmarks/results/protocol_netns.json`). Three network namespaces: the aggregator
({result["aggregator"]}) and two worker hosts ({", ".join(result["hosts"])}), veth links on a bridge
in the aggregator's namespace; {result["workers"]} worker processes, two per host, on a 2-block micro
model, 3 rounds. Impairment: {result["impairment"]}. Only addresses inside the namespaces are used.

TCP connect time (one round trip) from a worker host to the aggregator: median {rtt:.1f} ms, against
2 x {result["delay_ms"]} ms of added one-way delay. Rounds (accepted/expected, round duration): {rounds}. Versions {result["versions"]};
{result["updates"]["accepted"]} updates accepted, {result["updates"]["refused"]} refused.

Byte accounting checked from both ends: the aggregator's body bytes in for pushes
({by_ep["push"]["bytes_in"]:,}) equal the sum the workers sent ({result["workers_bytes_up"]:,}), and its bytes
out ({result["server_bytes_out"]:,}) equal the sum the workers received ({result["workers_bytes_down"]:,}),
whatever TCP retransmitted under the 1% loss.

| endpoint | requests | bytes in | bytes out |
|---|---:|---:|---:|
{rows}
""",
        RESEARCH / "decentralised.md",  # superseded by the WAN-shaped run of BENCHMARKS.md
    )
    print(f"netns: {result['impairment']}; connect {rtt:.1f} ms; wrote protocol_netns.json")


if __name__ == "__main__":
    main()
