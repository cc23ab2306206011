"""Multi-host on one machine: the aggregator and two worker hosts in their own network
namespaces, joined by veth links on a bridge, with a delay of tens of milliseconds and 1% packet
loss on every link. Only addresses inside those namespaces are used; the test process itself
reaches them only through `ip netns exec`.

The namespaces come from bench/netns.py (shared with bench/chaos.py and bench/wan_run.py).
Impairment: `tc netem` (delay 20ms loss 1%) on every veth when the kernel has sch_netem;
otherwise the same through netfilter: 1% loss with iptables' `statistic` match and the delay by
an NFQUEUE program (nfqueue_delay.py) in each namespace. Skips cleanly when namespaces cannot be
made (not root, no `ip`, no permission).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from blocktrain.protocol.ops.cluster import BLOCKTRAIN, Proc, spawn, start_worker, stop
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from tests.conftest import micro_config
from tests.protocol.conftest import run_state

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from netns import DELAY_MS, LOSS, NetnsUnavailable, build_net, probe  # bench/netns.py

pytestmark = [pytest.mark.network, pytest.mark.slow]


def test_rounds_across_namespaces_with_delay_and_loss(tmp_path, corpus):
    try:
        net = build_net()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    procs: list[Proc] = []
    try:
        cfg = micro_config()
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=2, blocks=2))
        state = run_state(
            tmp_path / "state", cfg, {"deadline_s": 30.0, "local_steps": 2, "max_rounds": 3}
        )
        tokens = []
        for i in range(4):
            tokens.append(new_token())
            state.ledger.add_token(f"w{i}", hash_token(tokens[-1]), time.time())
        observer = new_token()
        state.ledger.add_token("observer", hash_token(observer), time.time())
        logs = tmp_path / "logs"
        agg = spawn(
            "aggregator",
            [
                *BLOCKTRAIN,
                "aggregator",
                "--state",
                str(state.root),
                "--host",
                net.agg_ip,
                "--port",
                "0",
                "--insecure-http",  # a private network namespace
            ],
            logs,
            prefix=net.exec_prefix(net.agg),
        )
        procs.append(agg)
        url = None
        for _ in range(600):
            doc = state.read_endpoint()
            if doc is not None:
                url = str(doc["url"])
                break
            assert agg.popen.poll() is None, agg.stderr.read_text()
            time.sleep(0.1)
        assert url is not None and url.startswith(f"http://{net.agg_ip}:")
        port = int(url.rsplit(":", 1)[1])
        for i, tok in enumerate(tokens):  # two workers on each host namespace
            ns = net.hosts[i % 2]
            procs.append(
                start_worker(
                    url, tok, logs, name=f"worker-{i}", data=str(corpus), prefix=net.exec_prefix(ns)
                )
            )
        limit = time.monotonic() + 240
        ledger = StateDir(state.root).ledger
        while time.monotonic() < limit:
            if all(ledger.block_state(b)[1] >= 3 for b in range(2)):
                break
            for p in procs:
                assert p.popen.poll() in (None, 0), f"{p.name}: {p.stderr.read_text()[-500:]}"
            time.sleep(0.5)
        else:
            pytest.fail(f"rounds did not finish: {[ledger.block_state(b) for b in range(2)]}")
        report = probe(net, port, observer)
        status = report["status"]
        rtt = report["connect_s"][len(report["connect_s"]) // 2]
        assert rtt >= 2 * DELAY_MS / 1000 * 0.9, f"the link is not delayed: {rtt * 1e3:.1f} ms"
        for b in range(2):
            rounds = status["participation"][str(b)]
            assert [r["round"] for r in rounds] == [0, 1, 2]
            assert all(r["accepted"] >= 1 for r in rounds), rounds
        assert status["versions"] == [3, 3], status["versions"]
        # two workers a block, live or (done with the run's rounds) already left
        per_block = [sum(w["block"] == b for w in status["workers"]["list"]) for b in range(2)]
        assert per_block == [2, 2], status["workers"]
        # wait for the workers' exit reports, then match the byte accounting from both ends
        for p in procs[1:]:
            p.popen.wait(timeout=60)
        reports = [json.loads(p.stdout.read_text()) for p in procs[1:]]
        final = probe(net, port, observer)["status"]["bytes"]["by_endpoint"]
        server_in = sum(v["bytes_in"] for ep, v in final.items() if ep != "status")
        server_out = sum(v["bytes_out"] for ep, v in final.items() if ep != "status")
        pushed = sum(r["bytes_up"] for r in reports)
        assert final["push"]["bytes_in"] == pushed, "every pushed body byte is accounted for"
        assert server_out == sum(r["bytes_down"] for r in reports), (
            "every body byte the workers received is accounted for"
        )
        assert server_in >= pushed
        result = {
            "impairment": net.impairment,
            "delay_ms": DELAY_MS,
            "loss": LOSS,
            "namespaces": [net.agg, *net.hosts],
            "aggregator": url,
            "hosts": net.host_ips,
            "workers": len(tokens),
            "connect_ms": [x * 1e3 for x in report["connect_s"]],
            "rounds": {b: status["participation"][b] for b in status["participation"]},
            "updates": status["updates"],
            "versions": status["versions"],
            "bytes_by_endpoint": final,
            "server_bytes_in": server_in,
            "server_bytes_out": server_out,
            "workers_bytes_up": pushed,
            "workers_bytes_down": sum(r["bytes_down"] for r in reports),
            "worker_reports": reports,
        }
        if os.environ.get("BLOCKTRAIN_NETNS_RESULT"):  # bench/protocol_netns.py keeps it
            Path(os.environ["BLOCKTRAIN_NETNS_RESULT"]).write_text(json.dumps(result, indent=2))
        print(
            f"\n{net.impairment}; connect RTT {rtt * 1e3:.1f} ms; "
            f"{status['updates']['accepted']} accepted updates; bytes in {server_in}, "
            f"out {server_out}"
        )
        ledger.close()
    finally:
        stop(procs[1:] + procs[:1])
        net.teardown()
