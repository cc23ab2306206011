"""The disturbed run of bench/chaos.py: the aggregator and workers in network namespaces, and
the faults done to them (SIGKILLs, delay/loss/partition toggles, hostile clients)."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from blocktrain.data import resolve_data_path
from blocktrain.errors import ProtocolError
from blocktrain.presets import preset
from blocktrain.protocol.ops.cluster import Proc, start_aggregator, start_worker, stop
from blocktrain.protocol.store.state import create_state
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.training.local import initial_blocks
from netns import Net, delay_rule, iptables, loss_rule, sh  # bench/netns.py

PORT = 18731
BENCH = Path(__file__).resolve().parent
DELAY_QUEUE = 21


def settings(args: argparse.Namespace, rounds: int | None) -> dict[str, Any]:
    return {
        "deadline_s": args.deadline,
        "local_steps": args.local_steps,
        "n_workers": args.workers,
        "keep_versions": 0,  # every version kept: the CE is compared at equal rounds
        "max_rounds": rounds,
    }


def make_state(
    root: Path, args: argparse.Namespace, rounds: int | None
) -> tuple[StateDir, list[str], str]:
    cfg = preset("tiny")
    state = create_state(root, cfg, settings(args, rounds), initial_blocks(cfg))
    tokens = [new_token() for _ in range(args.workers)]
    for i, tok in enumerate(tokens):
        state.ledger.add_token(f"worker-{i}", hash_token(tok), time.time())
    observer = new_token()
    state.ledger.add_token("observer", hash_token(observer), time.time())
    return state, tokens, observer


class Soak:
    """The processes of the disturbed run and the faults done to them."""

    def __init__(self, net: Net, state: StateDir, tokens: list[str], args: argparse.Namespace):
        self.net, self.state, self.tokens, self.args = net, state, tokens, args
        self.rng = random.Random(args.seed)
        self.logs = state.root.parent / "logs"
        self.url = f"http://{net.agg_ip}:{PORT}"
        self.agg: Proc | None = None
        self.workers: dict[int, Proc | None] = dict.fromkeys(range(len(tokens)))
        self.restart_at: dict[str, float] = {}
        self.rules: list[tuple[float, str, list[str]]] = []  # (until, namespace, rule)
        self.events: list[dict[str, Any]] = []
        self.peak_rss_kb = 0
        self.rss_mb: list[tuple[float, float]] = []
        """(seconds into the soak, VmRSS MB) of the aggregator, every 10 s."""
        self.status_versions: list[list[int]] = []
        self.starts = {"aggregator": 0, "workers": 0}
        self.ipt = iptables()

    def log(self, kind: str, **what: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 1), "event": kind, **what})

    def start_aggregator(self) -> None:
        self.starts["aggregator"] += 1
        try:
            self.agg, _ = start_aggregator(
                self.state,
                self.logs,
                host=self.net.agg_ip,
                port=PORT,
                name=f"aggregator-{self.starts['aggregator']}",
                prefix=self.net.exec_prefix(self.net.agg),
            )
        except ProtocolError as exc:  # e.g. the port not yet free: try again shortly
            self.log("aggregator_start_failed", detail=str(exc)[:200])
            self.restart_at["aggregator"] = time.monotonic() + 2.0

    def start_worker(self, i: int) -> None:
        self.starts["workers"] += 1
        self.workers[i] = start_worker(
            self.url,
            self.tokens[i],
            self.logs,
            name=f"worker-{i}-{self.starts['workers']}",
            data=str(resolve_data_path(self.args.data)),
            prefix=self.net.exec_prefix(self.net.hosts[i % 2]),
        )

    # ------------------------------------------------------------------ faults

    def kill(self, proc: Proc, what: str) -> None:
        if proc.popen.poll() is None:
            os.kill(proc.popen.pid, signal.SIGKILL)  # its own pid only
            proc.popen.wait()
        proc.close_files()
        self.restart_at[what] = time.monotonic() + self.rng.uniform(1.0, 5.0)
        self.log("sigkill", target=what)

    def toggle(self, kind: str) -> None:
        ns = self.rng.choice(self.net.hosts)
        if kind == "delay":
            rules = [delay_rule(DELAY_QUEUE)]
        elif kind == "loss":
            rules = [loss_rule(0.05)]
        else:  # partition: nothing in or out
            rules = [
                ["OUTPUT", "!", "-o", "lo", "-j", "DROP"],
                ["INPUT", "!", "-i", "lo", "-j", "DROP"],
            ]
        until = time.monotonic() + self.rng.uniform(5.0, 20.0)
        for rule in rules:
            sh(*self.net.exec_prefix(ns), self.ipt or "iptables", "-I", *rule)
            self.rules.append((until, ns, rule))
        self.log(kind, namespace=ns, seconds=round(until - time.monotonic(), 1))

    def heal(self, everything: bool = False) -> None:
        now = time.monotonic()
        for entry in list(self.rules):
            until, ns, rule = entry
            if everything or until <= now:
                sh(*self.net.exec_prefix(ns), self.ipt or "iptables", "-D", *rule, check=False)
                self.rules.remove(entry)

    def hostile(self) -> subprocess.Popen[bytes]:
        self.log("hostile_clients")
        return subprocess.Popen(
            [
                *self.net.exec_prefix(self.net.hosts[1]),
                sys.executable,
                str(BENCH / "chaos_clients.py"),
                self.net.agg_ip,
                str(PORT),
                "--slowloris",
                "50",
                "--oversized-mb",
                str(self.args.oversized_mb),
                "--seconds",
                "40",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    # ------------------------------------------------------------------ the loop

    def sample(self, observer: str) -> None:
        if self.agg is not None and self.agg.popen.poll() is None:
            try:
                for line in Path(f"/proc/{self.agg.popen.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        kb = int(line.split()[1])
                        self.peak_rss_kb = max(self.peak_rss_kb, kb)
                        t = round(time.monotonic() - self.t0, 1)
                        if not self.rss_mb or t - self.rss_mb[-1][0] >= 10:
                            self.rss_mb.append((t, round(kb / 1024, 1)))
            except OSError:
                pass
        probe = (
            "import sys, urllib.request; r = urllib.request.Request(sys.argv[1] + "
            "'/v1/status?rounds=1', headers={'Authorization': 'Bearer ' + sys.argv[2]}); "
            "print(urllib.request.urlopen(r, timeout=3).read().decode())"
        )
        out = sh(
            *self.net.exec_prefix(self.net.agg),
            sys.executable,
            "-c",
            probe,
            self.url,
            observer,
            check=False,
            timeout=10,
        )
        if out.returncode == 0:
            self.status_versions.append(json.loads(out.stdout)["versions"])

    def run(self, observer: str) -> list[dict[str, Any]]:
        self.t0 = time.monotonic()
        self.start_aggregator()
        for i in self.workers:
            self.start_worker(i)
        end = self.t0 + self.args.minutes * 60
        span = self.args.minutes * 60
        # the first round starts undisturbed; the last stretch heals, so that rounds can close
        next_fault, calm_from = self.t0 + min(20.0, 0.1 * span), end - min(30.0, 0.15 * span)
        hostile: list[subprocess.Popen[bytes]] = []
        reports = []
        while time.monotonic() < end:
            time.sleep(1.0)
            self.sample(observer)
            self.heal()
            now = time.monotonic()
            for what, at in list(self.restart_at.items()):
                if at <= now:
                    del self.restart_at[what]
                    if what == "aggregator":
                        self.start_aggregator()
                    else:
                        self.start_worker(int(what.split("-")[1]))
            for i, w in self.workers.items():  # a worker that exited (refused, gave up): again
                if (
                    w is not None
                    and w.popen.poll() is not None
                    and f"worker-{i}" not in self.restart_at
                ):
                    w.close_files()
                    self.restart_at[f"worker-{i}"] = now + self.rng.uniform(1.0, 5.0)
            for h in list(hostile):
                if h.poll() is not None:
                    reports.append(json.loads((h.stdout.read() if h.stdout else b"{}") or b"{}"))
                    hostile.remove(h)
            if now < next_fault or now > calm_from:
                continue
            next_fault = now + self.rng.uniform(*self.args.fault_every)
            fault = self.rng.choice(
                [
                    "kill_aggregator",
                    "kill_worker",
                    "kill_worker",
                    "delay",
                    "loss",
                    "partition",
                    "hostile",
                ]
            )
            if fault == "kill_aggregator" and self.agg and "aggregator" not in self.restart_at:
                self.kill(self.agg, "aggregator")
            elif fault == "kill_worker":
                i = self.rng.choice(list(self.workers))
                w = self.workers[i]
                if w is not None and f"worker-{i}" not in self.restart_at:
                    self.kill(w, f"worker-{i}")
            elif fault in ("delay", "loss", "partition"):
                self.toggle(fault)
            elif fault == "hostile" and not hostile:
                hostile.append(self.hostile())
        self.heal(everything=True)
        for h in hostile:
            h.wait(timeout=60)
        return reports

    def stop(self) -> None:
        stop([w for w in self.workers.values() if w is not None])
        if self.agg is not None:
            stop([self.agg])
