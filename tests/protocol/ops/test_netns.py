"""Multi-host on one machine: the aggregator and two worker hosts in their own network
namespaces, joined by veth links on a bridge, with a delay of tens of milliseconds and 1% packet
loss on every link. Only addresses inside those namespaces are used; the test process itself
reaches them only through `ip netns exec`.

Impairment: `tc netem` (delay 20ms loss 1%) on every veth when the kernel has sch_netem;
otherwise the same through netfilter: 1% loss with iptables' `statistic` match and the delay by
an NFQUEUE program (nfqueue_delay.py) in each namespace. Skips cleanly when namespaces cannot be
made (not root, no `ip`, no permission).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blocktrain.protocol.ops.cluster import BLOCKTRAIN, Proc, spawn, start_worker, stop
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from tests.conftest import micro_config
from tests.protocol.conftest import run_state

pytestmark = [pytest.mark.network, pytest.mark.slow]

DELAY_MS = 20
LOSS = 0.01
SUBNET = "10.231.{}.{}"
HERE = Path(__file__).parent


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)


def iptables() -> str | None:
    for name in ("iptables-legacy", "iptables"):
        if shutil.which(name):
            return name
    if os.geteuid() == 0 and shutil.which("apt-get"):  # install it, bounded
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            sh("apt-get", "install", "-y", "-q", "iptables", timeout=300)
    return shutil.which("iptables-legacy") or shutil.which("iptables")


@dataclasses.dataclass
class Net:
    tag: str
    agg: str
    hosts: list[str]
    agg_ip: str
    host_ips: list[str]
    impairment: str = ""
    helpers: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    delay_ms: float = DELAY_MS
    """One-way delay each namespace adds to its outgoing packets (mean, with jitter_ms)."""
    jitter_ms: float = 0.0
    loss: float = LOSS

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def teardown(self) -> None:
        for p in self.helpers:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
                if p.poll() is None:
                    p.kill()
        for ns in [self.agg, *self.hosts]:
            sh("ip", "netns", "del", ns, check=False)


def loss_rule(probability: float) -> list[str]:
    """An iptables rule (chain and match, no -A/-I) that drops this share of a namespace's
    outgoing packets (this kernel has no sch_netem); bench/chaos_soak.py toggles it too."""
    return [
        "OUTPUT", "!", "-o", "lo", "-m", "statistic", "--mode", "random",
        "--probability", str(probability), "-j", "DROP",
    ]  # fmt: skip


def delay_rule(queue: int) -> list[str]:
    """An iptables rule that queues a namespace's outgoing packets for the delay program."""
    return ["OUTPUT", "!", "-o", "lo", "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]


def build_net(
    impaired: bool = True,
    *,
    hosts: int = 2,
    delay_ms: float = DELAY_MS,
    jitter_ms: float = 0.0,
    loss: float = LOSS,
) -> Net:
    """The aggregator's namespace and `hosts` worker hosts, impaired (delay +- jitter and loss
    on every namespace's egress) unless `impaired` is False (bench/chaos.py toggles its own
    impairments). bench/wan_run.py asks for 3 hosts and a WAN's delay."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not shutil.which("ip"):
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = f"bt{os.getpid() % 100000}"
    net = Net(
        tag,
        f"{tag}a",
        [f"{tag}h{i + 1}" for i in range(hosts)],
        SUBNET.format(0, 1),
        [SUBNET.format(0, 2 + i) for i in range(hosts)],
        delay_ms=delay_ms,
        jitter_ms=jitter_ms,
        loss=loss,
    )
    probe = sh("ip", "netns", "add", net.agg, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {probe.stderr.strip()}")
    try:
        for ns in net.hosts:
            sh("ip", "netns", "add", ns)
        sh("ip", "-n", net.agg, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", net.agg, "addr", "add", f"{net.agg_ip}/24", "dev", "br0")
        for ns in [net.agg, *net.hosts]:
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", net.agg, "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(zip(net.hosts, net.host_ips, strict=True)):
            a_end, h_end = f"va{i}", f"vh{i}"
            sh(
                "ip",
                "-n",
                net.agg,
                "link",
                "add",
                a_end,
                "type",
                "veth",
                "peer",
                "name",
                h_end,
                "netns",
                ns,
            )
            sh("ip", "-n", net.agg, "link", "set", a_end, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", h_end)
            sh("ip", "-n", ns, "link", "set", h_end, "up")
        if impaired:
            impair(net)
    except BaseException:
        net.teardown()
        raise
    return net


def impair(net: Net) -> None:
    links = [(net.agg, f"va{i}") for i in range(len(net.hosts))] + [
        (ns, f"vh{i}") for i, ns in enumerate(net.hosts)
    ]
    jitter = f" +- {net.jitter_ms:g}ms" if net.jitter_ms else ""
    netem_args = ["delay", f"{net.delay_ms:g}ms"]
    netem_args += [f"{net.jitter_ms:g}ms"] if net.jitter_ms else []
    netem_args += ["loss", f"{net.loss * 100:g}%"]

    def netem(ns: str, dev: str, check: bool) -> subprocess.CompletedProcess:
        return sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", *netem_args,
                  check=check)  # fmt: skip

    first = netem(*links[0], check=False) if shutil.which("tc") else None
    if first is not None and first.returncode == 0:
        for ns, dev in links[1:]:
            netem(ns, dev, check=True)
        net.impairment = (
            f"tc netem delay {net.delay_ms:g}ms{jitter} loss {net.loss:.0%} on every veth"
        )
        return
    ipt = iptables()
    if ipt is None:
        pytest.skip("no netem in this kernel and no iptables for the netfilter fallback")
    for q, ns in enumerate([net.agg, *net.hosts]):
        # egress of each namespace: drop a share, queue the rest for the delay program
        rules = [["-A", *loss_rule(net.loss)], ["-A", *delay_rule(10 + q)]]
        for rule in rules:
            done = sh("ip", "netns", "exec", ns, ipt, *rule, check=False)
            if done.returncode != 0:
                pytest.skip(f"netfilter fallback unavailable: {done.stderr.strip()}")
        helper = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                str(HERE / "nfqueue_delay.py"),
                "--queue",
                str(10 + q),
                "--delay-ms",
                str(net.delay_ms),
                "--jitter-ms",
                str(net.jitter_ms),
                "--seed",
                str(q),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        net.helpers.append(helper)
        line = helper.stdout.readline() if helper.stdout else ""
        if line.strip() != "ready":
            err = helper.stderr.read() if helper.stderr else ""
            pytest.skip(f"NFQUEUE delay unavailable: {err.strip()[:200]}")
    net.impairment = (
        f"netfilter: statistic drop {net.loss:.0%} + NFQUEUE delay {net.delay_ms:g}ms{jitter} on "
        "each namespace's egress (no sch_netem in this kernel)"
    )


PROBE = r"""
import json, socket, sys, time, urllib.request
host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rtts = []
for _ in range(5):
    t = time.monotonic()
    s = socket.create_connection((host, port), timeout=10)
    rtts.append(time.monotonic() - t)
    s.close()
req = urllib.request.Request(f"http://{host}:{port}/v1/status?rounds=1000",
                             headers={"Authorization": f"Bearer {token}"})
status = json.load(urllib.request.urlopen(req, timeout=30))
print(json.dumps({"connect_s": sorted(rtts), "status": status}))
"""


def probe(net: Net, port: int, token: str) -> dict:
    """Connect times and /v1/status, measured from inside worker host 1."""
    out = sh(
        *net.exec_prefix(net.hosts[0]),
        sys.executable,
        "-c",
        PROBE,
        net.agg_ip,
        str(port),
        token,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_rounds_across_namespaces_with_delay_and_loss(tmp_path, corpus):
    net = build_net()
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
