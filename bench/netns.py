"""Network-namespace scaffolding for the multi-host runs on one machine: an aggregator's
namespace and worker-host namespaces, joined by veth links on a bridge in the aggregator's
namespace, all on this machine (a namespace sees only its own addresses, so the processes talk
over real links instead of one loopback). Used by tests/protocol/ops/test_netns.py and by
bench/chaos.py, bench/chaos_soak.py and bench/wan_run.py.

Impairment (delay +- jitter and loss on each namespace's egress): `tc netem` on every veth when
the kernel has sch_netem. This machine's kernel lacks it, so otherwise the same is done through
netfilter: the loss with iptables' `statistic` match (loss_rule) and the delay by queueing the
packets (delay_rule: NFQUEUE) to the delay program bench/nfqueue_delay.py in each namespace.
bench/chaos_soak.py toggles the same rules at run time.

Needs root and iproute2 (`ip`); iptables for the netfilter fallback (installed with apt-get when
missing and root). When namespaces cannot be built, build_net raises NetnsUnavailable with the
reason: the test skips on it, the bench scripts exit with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DELAY_MS = 20
LOSS = 0.01
SUBNET = "10.231.{}.{}"
DELAY_PROGRAM = Path(__file__).resolve().parent / "nfqueue_delay.py"  # bench/nfqueue_delay.py
"""The NFQUEUE delay program, run inside a namespace (`ip netns exec NS python DELAY_PROGRAM`)."""


class NetnsUnavailable(Exception):
    """The namespaces or their impairment cannot be made here (not root, no `ip`, no permission,
    no netfilter fallback): the test skips on it, the bench scripts exit with it."""


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
        raise NetnsUnavailable("network namespaces need root")
    if not shutil.which("ip"):
        raise NetnsUnavailable("iproute2 (`ip`) is not installed")
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
        raise NetnsUnavailable(f"cannot create a network namespace: {probe.stderr.strip()}")
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
        raise NetnsUnavailable("no netem in this kernel and no iptables for the netfilter fallback")
    for q, ns in enumerate([net.agg, *net.hosts]):
        # egress of each namespace: drop a share, queue the rest for the delay program
        rules = [["-A", *loss_rule(net.loss)], ["-A", *delay_rule(10 + q)]]
        for rule in rules:
            done = sh("ip", "netns", "exec", ns, ipt, *rule, check=False)
            if done.returncode != 0:
                raise NetnsUnavailable(f"netfilter fallback unavailable: {done.stderr.strip()}")
        helper = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                str(DELAY_PROGRAM),
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
            raise NetnsUnavailable(f"NFQUEUE delay unavailable: {err.strip()[:200]}")
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
