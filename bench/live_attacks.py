"""Denial of service, live: hostile clients (bench/live_attackers.py, each its own process)
against the real servers on loopback, an honest client measured before and while each attack
runs. Writes benchmarks/results/live_attacks.json (live_attacks-quick.json with --quick;
live_attacks-small.json and its own section with --preset small) and the "live-attacks"
section of BENCHMARKS.md.

Against the aggregator (`blocktrain aggregator` of --preset, tiny by default, its effect probe
on, two honest `blocktrain worker`s training block 0 for real; a fresh aggregator per attack,
one for all three with --quick):

    push_flood       one attacker token pushes valid-shaped deltas (noise at half the norm
                     bound, each body different) naming the open round, from 8 connections
                     as fast as the aggregator answers, re-registering its worker whenever
                     a push is refused as a duplicate
    quorum_stuffing  3 attacker tokens pull each round of block 0 as it opens and push junk
                     for it at once (a tensor of the wrong shape, or a NaN)
    halfopen         1000 connections at a time sending half a request head, each re-opened
                     as soon as the server answers or closes it
    halfopen_4_addresses   130 such connections from each of 4 addresses (127.0.0.2-5): each
                     under the cap of 128 per address but for two, 520 in all, over the 512
                     a server holds
    near_replay      (issue 58) a token trains one update of block 0 for real, has it
                     accepted, then pushes it again in every later round, re-stamped, with one
                     fp16 value moved by one ulp or noise of 1e-3 of its norm, in turn
    near_copy        (issue 58) another token pushes, in the same round, each first honest body
                     of block 0 it reads (the aggregator's pending folder, standing in for a
                     body sniffed off plain http), one value moved by one ulp
    noise_probe      (issue 58) 6 tokens push zero-mean Gaussian noise at 0.1, 0.5 and 1 x the
                     norm bound (just inside it), 3 on block 0 and 3 on the last block, every
                     round of their block

These rows and halfopen_4_addresses pass only with none of the attacker's updates accepted
(near_replay's trained original is not one) and at least 0.975 of the honest requests served.

Against the router (`blocktrain serve` in front of three `blocktrain serve-block` hosts, a tiny
model trained 20 steps; at the tiny preset only):

    halfopen, halfopen_4_addresses   as above
    unread_streams   8 streamed completions of 4096 bytes kept open, never read (a 4 KiB
                     receive buffer: the stream stalls at once), each re-opened when the
                     server ends it
    unread_streams_4_addresses   the same from each of 4 addresses (127.0.0.2-5)
    stop_strings     completions carrying 1 MB of stop strings (1 KiB strings by the
                     thousand, or four of 250 KB), from 4 connections as fast as answered

Against block host 0 of that chain (the host target): halfopen_4_addresses.

Every attacker connects from 127.0.0.2 (but the rows of 4 addresses), the honest clients
(workers included) from 127.0.0.1:
on loopback, one other client address (of the same /24: the servers' caps per prefix count
them together). Each attack: the honest client's requests for
--unloaded seconds, then while the attack runs for --attack seconds, then --settle seconds
(25, 30 and 5 at the tiny preset's deadline of 12 s; the defaults scale with --deadline, whose
own default is 30 s at a larger preset: its rounds take longer).
The honest client opens a new connection for every request (one every --interval s): against
the aggregator GET /v1/status (an observer's token) and GET /v1/blocks/0/versions/V (the
version the status names, ~1 MB); against the router a completion of 8 bytes; against a host
GET /v1/info. The target server's RSS is sampled every 0.5 s.

A row passes when, for each honest request, the median while attacked is within --factor (2)
x the unloaded median and every honest request was served (200); and, against the aggregator,
each honest worker's updates still land in time (no more refused `late` than unloaded, and
some accepted when the attack lasts two deadlines), the median round is within --factor x its
unloaded length, no round closed early before the minimum round length, and the peak RSS
stays within --rss-growth-mb of its level before the attack. A failing row is reported as it
is. The attackers run on the same machine: the table shows the CPU they and the server took.
Every row also says `honest_served_share` (the honest requests served while attacked, of all
sent then; issue 58's bar: at least 0.975) and `attacker_accepted` (the attacker's pushes
answered 200, accepted: 0 for a connection attack).

    python bench/live_attacks.py            # the full figures: ~10-15 min on 2 free cores
    python bench/live_attacks.py --quick    # a smoke: short windows, one aggregator
    python bench/live_attacks.py --only halfopen,unread_streams   # the other rows of the JSON
                                            # stay, when measured under the same settings
    python bench/live_attacks.py --only halfopen_4_addresses@aggregator   # ATTACK@TARGET: one
                                            # server's row (~75 s)
    python bench/live_attacks.py --preset small   # the aggregator at the small shape (its probe
                                            # a forward pass of a 2-layer block of d = 256):
                                            # live_attacks-small.json, ~10 min
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blocktrain.data import resolve_data_path
from blocktrain.presets import PRESETS, preset
from blocktrain.protocol.core.bodies import SAFETENSORS_CODES, wire_dtype
from blocktrain.protocol.ops.cluster import Proc, spawn, start_aggregator, start_worker, stop
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.simulate.attacks.forge import AT_BOUND
from report import (  # bench/report.py
    BLOCKTRAIN,
    RESULTS,
    ROOT,
    cluster_state,
    free_ports,
    machine,
    trained,
    update_section,
    wait_healthy,
    write_json,
)

BENCH = Path(__file__).resolve().parent
ATTACKERS = BENCH / "live_attackers.py"
HONEST = "127.0.0.1"
ATTACKER = "127.0.0.2"
MODEL = "live-attacks-tiny"
ROUTER_PRESET = "tiny"
"""The router's rows serve a tiny model, and run at that preset only."""

FOUR = tuple(f"127.0.0.{2 + i}" for i in range(4))
"""The sources of the rows of 4 addresses."""

SCREENED = ("near_replay", "near_copy", "noise_probe")
"""Attacks whose updates the screens must refuse every one of (issue 58)."""
AGGREGATOR_ATTACKS = (
    "push_flood",
    "quorum_stuffing",
    "halfopen",
    "halfopen_4_addresses",
    *SCREENED,
)
ROUTER_ATTACKS = (
    "halfopen",
    "halfopen_4_addresses",
    "unread_streams",
    "unread_streams_4_addresses",
    "stop_strings",
)
HOST_ATTACKS = ("halfopen_4_addresses",)
TARGETS = {"aggregator": AGGREGATOR_ATTACKS, "router": ROUTER_ATTACKS, "host": HOST_ATTACKS}
BARRED = (*SCREENED, "halfopen_4_addresses")
"""Issue 58's rows: none of the attacker's updates accepted, SERVED_SHARE of honest calls served."""
SERVED_SHARE = 0.975
"""The share of the honest client's requests their rows must see served."""
NOISE_SHARES = (0.1, 0.5, 1.0)
NOISE_VARIANTS = 2
"""Directions of noise per share and block, pushed in turn."""
STUFFERS = 3
"""Attacker tokens of quorum_stuffing."""


# ---------------------------------------------------------------------------------------------
# The pure part: samples, summaries, checks, the markdown (tests/bench/test_live_attacks.py)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One honest request: its kind, when it started (wall clock), how long it took, and its
    outcome (an HTTP status, or the name of the error that ended it)."""

    kind: str
    at: float
    seconds: float
    outcome: int | str


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linearly interpolated between order statistics."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(samples: list[Sample]) -> dict[str, Any]:
    """Latency (of the served requests, in ms) and outcomes of one kind of honest request."""
    served = [s.seconds * 1000 for s in samples if s.outcome == 200]
    outcomes = Counter(str(s.outcome) for s in samples)
    return {
        "n": len(samples),
        "median_ms": statistics.median(served) if served else None,
        "p90_ms": percentile(served, 0.9) if served else None,
        "max_ms": max(served) if served else None,
        "outcomes": dict(sorted(outcomes.items())),
        "failed": sum(n for k, n in outcomes.items() if k != "200"),
    }


def ratio(loaded: float | None, unloaded: float | None) -> float | None:
    if loaded is None or not unloaded:
        return None
    return loaded / unloaded


def honest_entry(unloaded: list[Sample], loaded: list[Sample], factor: float) -> dict[str, Any]:
    """One kind of honest request, unloaded against attacked, and its verdict: the attacked
    median within `factor` x the unloaded one, and every request served."""
    u, a = summary(unloaded), summary(loaded)
    r = ratio(a["median_ms"], u["median_ms"])
    return {
        "unloaded": u,
        "loaded": a,
        "ratio": r,
        "p90_ratio": ratio(a["p90_ms"], u["p90_ms"]),
        "within_factor": r is not None and r <= factor,
        "all_served": u["n"] > 0 and a["n"] > 0 and a["failed"] == 0,
    }


def worker_outcomes(updates: list[dict[str, Any]], names: dict[int, str]) -> dict[str, Any]:
    """Each honest worker's updates (ledger rows: token_id, fate, reason): accepted, refused
    `late`, and every refusal by reason."""
    out: dict[str, Any] = {
        name: {"accepted": 0, "late": 0, "refused": {}} for name in names.values()
    }
    for u in updates:
        name = names.get(u["token_id"])
        if name is None:
            continue
        entry = out[name]
        if u["fate"] == "accepted":
            entry["accepted"] += 1
        else:
            entry["refused"][u["reason"]] = entry["refused"].get(u["reason"], 0) + 1
            entry["late"] += u["reason"] == "late"
    return out


def in_time(unloaded: dict[str, Any], attacked: dict[str, Any], rounds_due: bool) -> bool:
    """No honest worker had more updates refused late while attacked than over the same time
    unloaded, and (when the attack lasted long enough for a round to close even at its
    deadline, `rounds_due`) each had updates accepted while attacked."""
    return all(
        attacked[w]["late"] <= unloaded[w]["late"]
        and (attacked[w]["accepted"] > 0 or not rounds_due)
        for w in unloaded
    )


def round_stats(rounds: list[dict[str, Any]], min_round_s: float) -> dict[str, Any]:
    """Rounds (ledger rows) closed in a window: how many, their lengths, their causes, and those
    closed early (not at the deadline) before the minimum round length."""
    lengths = [r["closed_at"] - r["started_at"] for r in rounds if r["started_at"] is not None]
    early = [
        r
        for r in rounds
        if r["cause"] != "deadline"
        and r["started_at"] is not None
        and r["closed_at"] - r["started_at"] < min_round_s - 0.05  # the ticker's 0.1 s grain
    ]
    causes = Counter(r["cause"] for r in rounds)
    return {
        "closed": len(rounds),
        "median_s": statistics.median(lengths) if lengths else None,
        "causes": dict(sorted(causes.items())),
        "early_before_min_round": len(early),
        "accepted": sum(r["accepted"] for r in rounds),
    }


def rss_stats(rss: list[tuple[float, float]], t0: float, t1: float, end: float) -> dict[str, Any]:
    """RSS (MB) before the attack (the last sample before t0), its peak during [t0, t1] and the
    last sample up to `end` (after the settle time)."""
    before = [mb for t, mb in rss if t < t0]
    during = [mb for t, mb in rss if t0 <= t <= t1]
    after = [mb for t, mb in rss if t1 < t <= end]
    return {
        "before": before[-1] if before else None,
        "peak": max(during) if during else None,
        "after": after[-1] if after else None,
    }


def checks_of(row: dict[str, Any], factor: float, rss_growth_mb: float) -> dict[str, bool]:
    """The row's checks, by name (see the module docstring)."""
    checks: dict[str, bool] = {}
    for kind, h in row["honest"].items():
        checks[f"{kind}_within_{factor:g}x"] = h["within_factor"]
        checks[f"{kind}_all_served"] = h["all_served"]
    if "workers" in row:
        due = row["windows_s"]["attack"] >= 2 * row["deadline_s"]
        checks["honest_updates_in_time"] = in_time(
            row["workers"]["unloaded"], row["workers"]["attack"], due
        )
    if "rounds" in row:
        ru, ra = row["rounds"]["unloaded"], row["rounds"]["attack"]
        checks["no_early_round_before_min"] = ra["early_before_min_round"] == 0
        if ru["median_s"] is not None and ra["median_s"] is not None:
            checks[f"rounds_within_{factor:g}x"] = ra["median_s"] <= factor * ru["median_s"]
    if row["attack"] in BARRED:
        checks["no_attacker_update_accepted"] = row["attacker_accepted"] == 0
        share = row["honest_served_share"]
        checks[f"honest_served_{SERVED_SHARE:g}"] = share is not None and share >= SERVED_SHARE
    rss = row.get("rss_mb") or {}
    if row["target"] == "aggregator" and rss.get("before") is not None:
        checks["rss_bounded"] = (
            rss["peak"] is not None and rss["peak"] - rss["before"] <= rss_growth_mb
        )
    return checks


def honest_served_share(row: dict[str, Any]) -> float | None:
    """The honest requests served (200) while attacked, of all sent then, every kind together."""
    sent = sum(h["loaded"]["n"] for h in row["honest"].values())
    failed = sum(h["loaded"]["failed"] for h in row["honest"].values())
    return (sent - failed) / sent if sent else None


def attacker_accepted(row: dict[str, Any]) -> int:
    """The attacker's pushes the aggregator answered 200 (accepted); none for the attacks that
    push nothing."""
    outcomes = row["attacker"].get("outcomes", {})
    return sum(n for k, n in outcomes.items() if k.startswith("push 200"))


def scored(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its two headline figures (issue 58), read from what it holds: so rows
    measured before they existed get them too. A screened row's count of accepted updates,
    read from the ledger (screened_of), stands."""
    accepted = row["attacker_accepted"] if "attacker_accepted" in row else attacker_accepted(row)
    return {**row, "attacker_accepted": accepted, "honest_served_share": honest_served_share(row)}


def finish_row(row: dict[str, Any], factor: float, rss_growth_mb: float) -> dict[str, Any]:
    row = scored(row)
    row["checks"] = checks_of(row, factor, rss_growth_mb)
    row["passed"] = all(row["checks"].values())
    return row


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v:,}" for k, v in counts.items()) or "none"


def _workers(entry: dict[str, Any]) -> str:
    return "; ".join(
        f"{w} {e['accepted']} ok, {e['late']} late"
        + (f" ({_counts({k: v for k, v in e['refused'].items() if k != 'late'})})"
           if set(e["refused"]) - {"late"} else "")
        for w, e in entry.items()
    )  # fmt: skip


def _provenance(rows: list[dict]) -> str:
    """Which commit measured which rows, when they are not all one's (`--only` merges)."""
    commits: dict[str, list[str]] = {}
    for r in rows:
        commits.setdefault(r.get("commit") or "?", []).append(f"{r['attack']} ({r['target']})")
    if len(commits) <= 1:
        return ""
    parts = [f"{c}: {', '.join(names)}" for c, names in commits.items()]
    return " Rows measured at several commits: " + "; ".join(parts) + "."


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    s = result["settings"]
    lines = [
        f"`{result['command']}`; JSON: `benchmarks/results/{result['json']}`. "
        f"{'Quick mode: ' if s['quick'] else ''}{s['unloaded_s']:g} s unloaded, then "
        f"{s['attack_s']:g} s attacked, per attack; an honest request every {s['interval_s']:g} s "
        "on a new connection from 127.0.0.1, the attackers from 127.0.0.2 (the rows of 4 "
        f"addresses from 127.0.0.2-5). Aggregator: {s.get('preset', 'tiny')} "
        f"preset, 2 honest workers on block 0, deadline {s['deadline_s']:g} s, H = "
        f"{s['local_steps']}, minimum round {s['min_round_s']:g} s. "
        + (
            "Router: 3 block hosts of a tiny model trained 20 steps (host: the first of them). "
            if any(r["target"] in ("router", "host") for r in rows)
            else ""
        )
        + "Pass: median within "
        f"{s['factor']:g}x unloaded and every honest request served (and, at the aggregator, the "
        f"honest updates in time, rounds within {s['factor']:g}x their unloaded length, no early "
        f"round before the minimum, RSS growth under {s['rss_growth_mb']:g} MB)."
        + _provenance(rows),
        "",
        "| attack | server | honest request | unloaded median (ms) | attacked median (ms) | "
        "attacked p90 (ms) | ratio | honest outcomes attacked | verdict |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        for kind, h in r["honest"].items():
            verdict = (
                "pass"
                if r["passed"]
                else "**FAIL**: " + ", ".join(k for k, ok in r["checks"].items() if not ok)
            )
            lines.append(
                f"| {r['attack']} | {r['target']} | {kind} | {_ms(h['unloaded']['median_ms'])} | "
                f"{_ms(h['loaded']['median_ms'])} | {_ms(h['loaded']['p90_ms'])} | "
                f"{_x(h['ratio'])} | {_counts(h['loaded']['outcomes'])} | {verdict} |"
            )
    agg = [r for r in rows if r["target"] == "aggregator"]
    if agg:
        lines += [
            "",
            "| attack | honest workers unloaded | honest workers attacked | rounds unloaded "
            "(median s) | rounds attacked (median s) | early before the minimum | aggregator RSS "
            "MB before / peak / after |",
            "|---|---|---|---|---|---:|---|",
        ]
        for r in agg:
            ru, ra, m = r["rounds"]["unloaded"], r["rounds"]["attack"], r["rss_mb"]
            lines.append(
                f"| {r['attack']} | {_workers(r['workers']['unloaded'])} | "
                f"{_workers(r['workers']['attack'])} | {ru['closed']} ({_s(ru['median_s'])}) | "
                f"{ra['closed']} ({_s(ra['median_s'])}) | {ra['early_before_min_round']} | "
                f"{_mb(m['before'])} / {_mb(m['peak'])} / {_mb(m['after'])} |"
            )
    lines += [
        "",
        "| attack | server | honest served attacked | attacker's updates accepted | server CPU "
        "unloaded → attacked (cores) | attacker CPU (cores) | what the attacker saw |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        a, cpu = r["attacker"], r.get("server_cpu", {})
        mine = a["cpu_s"] / a["seconds"] if a.get("seconds") else None
        lines.append(
            f"| {r['attack']} | {r['target']} | {_share(r['honest_served_share'])} | "
            f"{r['attacker_accepted']:,} | {_cores(cpu.get('unloaded'))} → "
            f"{_cores(cpu.get('attack'))} | {_cores(mine)} | {_counts(a.get('outcomes', {}))} |"
        )
    return "\n".join(lines)


def _cores(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _share(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _mb(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


# ---------------------------------------------------------------------------------------------
# Measuring: the honest client, the RSS sampler, the attackers' processes
# ---------------------------------------------------------------------------------------------


def timed_request(
    kind: str, port: int, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> tuple[Sample, bytes]:
    """One honest request on a new connection from 127.0.0.1 (10 s timeout)."""
    at, t0 = time.time(), time.perf_counter()
    conn = http.client.HTTPConnection(HONEST, port, timeout=10, source_address=(HONEST, 0))
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        outcome: int | str = r.status
    except (OSError, http.client.HTTPException) as exc:
        data, outcome = b"", type(exc).__name__
    finally:
        conn.close()
    return Sample(kind, at, time.perf_counter() - t0, outcome), data


class Honest:
    """The honest client of one server: `probe()` makes one round of its requests."""

    def __init__(self, probe: Callable[[], list[Sample]], interval_s: float) -> None:
        self.probe, self.interval_s = probe, interval_s

    def window(self, seconds: float) -> list[Sample]:
        samples: list[Sample] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.monotonic()
            samples += self.probe()
            time.sleep(max(0.0, self.interval_s - (time.monotonic() - t)))
        return samples


def aggregator_probe(port: int, token: str) -> Callable[[], list[Sample]]:
    auth = {"Authorization": f"Bearer {token}"}
    version = [0]

    def probe() -> list[Sample]:
        status, body = timed_request("status", port, "GET", "/v1/status?rounds=1", None, auth)
        if status.outcome == 200:
            version[0] = json.loads(body)["versions"][0]
        pull, _ = timed_request(
            "pull", port, "GET", f"/v1/blocks/0/versions/{version[0]}", None, auth
        )
        return [status, pull]

    return probe


def host_probe(port: int) -> Callable[[], list[Sample]]:
    def probe() -> list[Sample]:
        sample, _ = timed_request("info", port, "GET", "/v1/info", None, {})
        return [sample]

    return probe


def router_probe(port: int) -> Callable[[], list[Sample]]:
    n = [0]

    def probe() -> list[Sample]:
        n[0] += 1
        body = json.dumps(
            {"model": MODEL, "prompt": "The ", "max_tokens": 8, "seed": n[0]}
        ).encode()
        sample, _ = timed_request(
            "completion",
            port,
            "POST",
            "/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        return [sample]

    return probe


class RssSampler:
    """A process's VmRSS (MB) and CPU time (user + system, s) every `every_s` seconds, with the
    wall-clock time, in a thread."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, float]] = []
        self.cpu: list[tuple[float, float]] = []
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(OSError, ValueError, IndexError):
                now = time.time()
                stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.cpu.append((now, (int(stat[11]) + int(stat[12])) / self._tick))
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.samples.append((now, int(line.split()[1]) / 1024))

    def cpu_share(self, t0: float, t1: float) -> float | None:
        """The process's CPU time over [t0, t1] per second of wall time (1.0: one core)."""
        inside = [(t, c) for t, c in self.cpu if t0 <= t <= t1]
        if len(inside) < 2:
            return None
        (ta, ca), (tb, cb) = inside[0], inside[-1]
        return (cb - ca) / (tb - ta) if tb > ta else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@contextlib.contextmanager
def attacker(argv: list[str], seconds: float) -> Iterator[dict[str, Any]]:
    """Run `live_attackers.py ARGV --seconds S` for the with-block (from 127.0.0.2 unless ARGV
    names its --source addresses); the dict it yields gets the attacker's JSON report once it
    exits (killed if it has not 60 s after its time)."""
    sources = [] if "--source" in argv else ["--source", ATTACKER]
    cmd = [sys.executable, str(ATTACKERS), *argv, "--seconds", str(seconds), *sources]
    print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    report: dict[str, Any] = {}
    try:
        yield report
    finally:
        try:
            out, _ = proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its pid
            out, _ = proc.communicate()
        lines = [line for line in out.splitlines() if line.strip()]
        report.update(json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}"})


@dataclass
class Windows:
    """Wall-clock times of one attack's windows."""

    unloaded: tuple[float, float] = (0.0, 0.0)
    attack: tuple[float, float] = (0.0, 0.0)
    end: float = 0.0
    samples: dict[str, list[Sample]] = field(default_factory=dict)


def measure(
    honest: Honest, argv: list[str], args: argparse.Namespace, settle_s: float
) -> tuple[Windows, dict[str, Any]]:
    """The honest client unloaded, then while the attacker runs, then `settle_s`."""
    w = Windows()
    t = time.time()
    w.samples["unloaded"] = honest.window(args.unloaded)
    w.unloaded = (t, time.time())
    with attacker(argv, args.attack) as report:
        t = time.time()
        time.sleep(0.5)  # the attacker's process starts (no torch: a few tens of ms)
        w.samples["attack"] = honest.window(args.attack - 0.5)
        w.attack = (t, time.time())
    time.sleep(settle_s)
    w.end = time.time()
    return w, report


def honest_of(w: Windows, factor: float) -> dict[str, Any]:
    kinds = dict.fromkeys(s.kind for s in w.samples["unloaded"] + w.samples["attack"])
    return {
        k: honest_entry(
            [s for s in w.samples["unloaded"] if s.kind == k],
            [s for s in w.samples["attack"] if s.kind == k],
            factor,
        )
        for k in kinds
    }


def base_row(
    attack: str,
    target: str,
    w: Windows,
    report: dict[str, Any],
    rss: RssSampler,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """What every row holds: the honest requests, the server's RSS and CPU, the attacker's
    report and the windows' lengths."""
    return {
        "attack": attack,
        "target": target,
        "honest": honest_of(w, args.factor),
        "rss_mb": rss_stats(rss.samples, w.attack[0], w.attack[1], w.end),
        "server_cpu": {
            "unloaded": rss.cpu_share(*w.unloaded),
            "attack": rss.cpu_share(*w.attack),
        },
        "attacker": report,
        "windows_s": {
            "unloaded": w.unloaded[1] - w.unloaded[0],
            "attack": w.attack[1] - w.attack[0],
        },
    }


# ---------------------------------------------------------------------------------------------
# The aggregator
# ---------------------------------------------------------------------------------------------


def noise_delta(
    shapes: dict[str, list[int]], wire: str, norm: float, seed: int = 0
) -> tuple[list[dict[str, Any]], bytes]:
    """Gaussian noise of L2 norm `norm` in the tensors' `shapes`, in the wire dtype: the
    manifest (name, dtype code, shape, byte range) and raw bytes of an attacker's template."""
    gen = torch.Generator().manual_seed(seed)
    noise = {name: torch.randn(shape, generator=gen) for name, shape in sorted(shapes.items())}
    scale = norm / math.sqrt(sum(float(t.square().sum()) for t in noise.values()))
    manifest, chunks, offset = [], [], 0
    for name, t in noise.items():
        raw = (t * scale).to(wire_dtype(wire)).contiguous().view(torch.uint8).numpy().tobytes()
        manifest.append(
            {
                "name": name,
                "dtype": SAFETENSORS_CODES[wire],
                "shape": list(t.shape),
                "begin": offset,
                "end": offset + len(raw),
            }
        )
        chunks.append(raw)
        offset += len(raw)
    return manifest, b"".join(chunks)


def aggregator_config(port: int, observer: str) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {observer}"}
    _, body = timed_request("config", port, "GET", "/v1/config", None, auth)
    return dict(json.loads(body))


def write_template(
    config: dict[str, Any],
    folder: Path,
    local_steps: int,
    *,
    block: int = 0,
    share: float = 0.5,
    inside: float = 1.0,
    name: str = "template",
    seed: int = 0,
) -> Path:
    """An update attacker's template: block `block`'s tensors as noise at `share` of the norm
    bound (times `inside`) in the wire dtype, and what a push names (tokens, steps)."""
    protocol = config["protocol"]
    norm = inside * share * float(protocol["max_delta_norm"])
    wire = protocol["wire_dtype"]
    manifest, data = noise_delta(config["tensors"][str(block)], wire, norm, seed)
    run = config["run_config"]
    (folder / f"{name}.bin").write_bytes(data)
    path = folder / f"{name}.json"
    doc = {
        "tensors": manifest,
        "data": str(folder / f"{name}.bin"),
        "block": block,
        "share": share,
        "tokens": local_steps * run["train"]["batch_size"] * run["model"]["seq_len"],
        "steps": local_steps,
    }
    path.write_text(json.dumps(doc))
    return path


def noise_templates(config: dict[str, Any], folder: Path, local_steps: int) -> list[list[str]]:
    """noise_probe's templates: per (block 0 or the last, share of the bound) NOISE_VARIANTS
    directions of their own, just inside the bound (AT_BOUND of it at a share of 1)."""
    last = max(int(b) for b in config["tensors"])
    groups = []
    for block in (0, last):
        for share in NOISE_SHARES:
            group = []
            for v in range(NOISE_VARIANTS):
                path = write_template(
                    config,
                    folder,
                    local_steps,
                    block=block,
                    share=share,
                    inside=AT_BOUND,
                    name=f"noise-{block}-{share:g}-{v}",
                    seed=1000 * block + 100 * v + int(10 * share),
                )
                group.append(str(path))
            groups.append(group)
    return groups


def aggregator_argv(attack: str, url: str, port: int, files: dict[str, Any]) -> list[str]:
    if attack == "near_replay":
        return [
            "near-replay", url, "--token-file", files["near_replay"], "--preset",
            files["preset"], "--local-steps", str(files["local_steps"]), "--data", files["data"],
        ]  # fmt: skip
    if attack == "near_copy":
        return [
            "near-copy", url, "--token-file", files["near_copy"], "--template",
            files["template"], "--sniff", files["sniff"],
        ]  # fmt: skip
    if attack == "noise_probe":
        argv = ["noise-probe", url]
        for token, group in zip(files["noise"], files["noise_templates"], strict=True):
            argv += ["--token-file", token, "--template", ",".join(group)]
        return argv
    if attack == "push_flood":
        return ["push-flood", url, "--token-file", files["flood"], "--template", files["template"]]
    if attack == "quorum_stuffing":
        argv = ["stuffing", url, "--template", files["template"]]
        for f in files["stuffers"]:
            argv += ["--token-file", f]
        return argv
    if attack == "halfopen_4_addresses":
        return four_addresses(port, "/v1/status")
    return ["halfopen", HONEST, str(port), "--path", "/v1/status"]


def four_addresses(port: int, path: str) -> list[str]:
    """halfopen_4_addresses: 130 half-sent heads from each of FOUR."""
    argv = ["halfopen", HONEST, str(port), "--path", path, "--target", "130"]
    for source in FOUR:
        argv += ["--source", source]
    return argv


def ledger_rows(state: StateDir) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every update (its id, token, fate, reason, time) and every round of block 0."""
    rows = state.ledger._query("SELECT id, received, token_id, fate, reason FROM updates")
    updates = [dict(r) for r in rows]
    return updates, state.ledger.rounds(0)


def aggregator_rows(attacks: list[str], args: argparse.Namespace, tmp: Path) -> list[dict]:
    """One aggregator with two honest workers on block 0, and `attacks` one after another."""
    cfg = preset(args.preset)
    settings = {"deadline_s": args.deadline, "local_steps": args.local_steps, "keep_versions": 10}
    state, tokens, observer = cluster_state(tmp / "state", cfg, settings, workers=2)
    data = str(resolve_data_path(args.data))
    files: dict[str, Any] = {
        "stuffers": [],
        "noise": [],
        "preset": args.preset,
        "local_steps": args.local_steps,
        "data": data,
        "sniff": str(state.root / "pending" / "0"),
    }
    roles = ["flood", *["stuffers"] * STUFFERS, "near_replay", "near_copy"]
    roles += ["noise"] * (2 * len(NOISE_SHARES))
    for i, role in enumerate(roles):
        token = new_token()
        state.ledger.add_token(f"attacker-{i}", hash_token(token), time.time())
        path = tmp / f"attacker-{i}.token"
        path.write_text(token + "\n")
        if isinstance(files.get(role), list):
            files[role].append(str(path))
        else:
            files[role] = str(path)
    tokens_by_name = {
        r["name"]: r["id"] for r in state.ledger._query("SELECT id, name FROM tokens")
    }
    names = {i: n for n, i in tokens_by_name.items() if n.startswith("worker-")}
    attackers = {  # each screened attack's tokens (ids)
        attack: {tokens_by_name[f"attacker-{i}"] for i, r in enumerate(roles) if r == role}
        for attack, role in zip(SCREENED, ("near_replay", "near_copy", "noise"), strict=True)
    }
    logs = tmp / "logs"
    agg, url = start_aggregator(state, logs, extra=["--data", data])
    procs: list[Proc] = [agg]
    rows = []
    try:
        for i, token in enumerate(tokens):
            procs.append(
                start_worker(
                    url, token, logs, name=f"worker-{i}", data=data, extra=["--block", "0"]
                )
            )
        port = int(url.rsplit(":", 1)[1])
        rss = RssSampler(agg.popen.pid)
        warm_up(port, observer, procs, args)
        config = aggregator_config(port, observer)
        files["template"] = str(write_template(config, tmp, args.local_steps))
        files["noise_templates"] = noise_templates(config, tmp, args.local_steps)
        honest = Honest(aggregator_probe(port, observer), args.interval)
        measured = []
        for attack in attacks:
            print(f"live_attacks: {attack} against the aggregator ...", file=sys.stderr, flush=True)
            # an attacker's worker that reported is expected one more round: let it pass
            settle = max(args.settle, args.deadline + 1) if len(attacks) > 1 else args.settle
            w, report = measure(honest, aggregator_argv(attack, url, port, files), args, settle)
            measured.append((attack, w, report))
        rss.stop()
    finally:
        stop(procs[1:])
        stop(procs[:1])
    updates, rounds = ledger_rows(StateDir(state.root))
    min_round = args.deadline / 4
    for attack, w, report in measured:

        def within(t0: float, t1: float) -> list[dict[str, Any]]:
            return [u for u in updates if t0 <= u["received"] <= t1]

        def closed(t0: float, t1: float) -> list[dict[str, Any]]:
            return [r for r in rounds if t0 <= r["closed_at"] <= t1]

        row = {
            **base_row(attack, "aggregator", w, report, rss, args),
            "deadline_s": args.deadline,
            "workers": {
                "unloaded": worker_outcomes(within(*w.unloaded), names),
                "attack": worker_outcomes(within(*w.attack), names),
            },
            "rounds": {
                "unloaded": round_stats(closed(*w.unloaded), min_round),
                "attack": round_stats(closed(*w.attack), min_round),
            },
        }
        if attack in SCREENED:
            row.update(screened_of(within(w.attack[0], w.end), attackers[attack], report))
        rows.append(finish_row(row, args.factor, args.rss_growth_mb))
    return rows


def screened_of(
    updates: list[dict[str, Any]], tokens: set[int], report: dict[str, Any]
) -> dict[str, Any]:
    """A screened attack's tokens' updates accepted from the attack's start to the end of its
    settle time (near_replay's trained original aside), read from the ledger."""
    original = report.get("original_update_id")
    accepted = [
        u for u in updates if u["token_id"] in tokens and u["fate"] == "accepted" and u["id"] != original
    ]  # fmt: skip
    return {"attacker_accepted": len(accepted)}


def warm_up(port: int, observer: str, procs: list[Proc], args: argparse.Namespace) -> None:
    """Until block 0 has closed two rounds with updates accepted (the workers are training)."""
    auth = {"Authorization": f"Bearer {observer}"}
    limit = time.monotonic() + args.warm_up
    while time.monotonic() < limit:
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}: {p.stderr}")
        sample, body = timed_request("status", port, "GET", "/v1/status?rounds=5", None, auth)
        if sample.outcome == 200 and json.loads(body)["versions"][0] >= 2:
            return
        time.sleep(1.0)
    raise RuntimeError(f"block 0 did not reach version 2 within {args.warm_up:g} s")


# ---------------------------------------------------------------------------------------------
# The router
# ---------------------------------------------------------------------------------------------


def router_argv(attack: str, url: str, port: int) -> list[str]:
    if attack == "halfopen":
        return ["halfopen", HONEST, str(port), "--path", "/v1/models"]
    if attack == "halfopen_4_addresses":
        return four_addresses(port, "/v1/models")
    if attack.startswith("unread_streams"):
        argv = ["unread-streams", url, "--model", MODEL, "--streams", "8", "--rcvbuf", "4096"]
        if attack == "unread_streams_4_addresses":
            for source in FOUR:
                argv += ["--source", source]
        return argv
    return ["stop-strings", url, "--model", MODEL, "--mb", "1"]


def router_rows(
    attacks: list[str], host_attacks: list[str], args: argparse.Namespace, tmp: Path
) -> list[dict]:
    """The router in front of three hosts: `attacks` against the router, then `host_attacks`
    against the first host."""
    data = str(resolve_data_path(args.data))  # --data, as the aggregator's rows read it
    run = trained(
        ROOT / "runs" / MODEL, ["--preset", ROUTER_PRESET, "--steps", "20", "--data", data]
    )
    ports = free_ports(4)
    logs = tmp / "router-logs"
    procs = []
    try:
        for b in range(3):
            argv = [
                *BLOCKTRAIN,
                "serve-block",
                str(run),
                "--blocks",
                str(b),
                "--port",
                str(ports[b]),
            ]
            procs.append(spawn(f"host-{b}", [*argv, "--threads", "1"], logs))
        hosts = ",".join(f"http://{HONEST}:{p}" for p in ports[:3])
        procs.append(
            spawn("router", [*BLOCKTRAIN, "serve", "--hosts", hosts, "--port", str(ports[3])], logs)
        )
        url = f"http://{HONEST}:{ports[3]}"
        for p in ports[:3]:
            wait_healthy(f"http://{HONEST}:{p}", [x.popen for x in procs])
        wait_healthy(url, [x.popen for x in procs])
        wait_ready(url)
        rss = RssSampler(procs[-1].popen.pid)
        honest = Honest(router_probe(ports[3]), args.interval)
        honest.window(2.0)  # the first requests warm the hosts' caches
        rows = []
        for attack in attacks:
            print(f"live_attacks: {attack} against the router ...", file=sys.stderr, flush=True)
            w, report = measure(honest, router_argv(attack, url, ports[3]), args, args.settle)
            row = base_row(attack, "router", w, report, rss, args)
            rows.append(finish_row(row, args.factor, args.rss_growth_mb))
        rss.stop()
        host = Honest(host_probe(ports[0]), args.interval)
        host_rss = RssSampler(procs[0].popen.pid)
        for attack in host_attacks:
            print(f"live_attacks: {attack} against host 0 ...", file=sys.stderr, flush=True)
            w, report = measure(host, four_addresses(ports[0], "/v1/info"), args, args.settle)
            row = base_row(attack, "host", w, report, host_rss, args)
            rows.append(finish_row(row, args.factor, args.rss_growth_mb))
        host_rss.stop()
    finally:
        stop(procs[-1:])
        stop(procs[:-1])
    return rows


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    limit = time.monotonic() + timeout_s
    port = int(url.rsplit(":", 1)[1])
    while time.monotonic() < limit:
        sample, _ = timed_request("ready", port, "GET", "/readyz", None, {})
        if sample.outcome == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}/readyz did not answer 200 within {timeout_s:g} s")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "preset": args.preset,
        "quick": args.quick,
        "unloaded_s": args.unloaded,
        "attack_s": args.attack,
        "settle_s": args.settle,
        "interval_s": args.interval,
        "deadline_s": args.deadline,
        "min_round_s": args.deadline / 4,
        "local_steps": args.local_steps,
        "factor": args.factor,
        "rss_growth_mb": args.rss_growth_mb,
        "honest_address": HONEST,
        "attacker_address": ATTACKER,
    }


def merged_rows(path: Path, rows: list[dict], settings: dict[str, Any]) -> list[dict]:
    """`rows` over the rows of the JSON at `path` (by attack and target), in the bench's order,
    when that JSON was measured under the same `settings`; else `rows` alone. Each row keeps
    the commit it was measured at."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return rows
    if old.get("settings") != settings:
        return rows
    order = [(a, target) for target, attacks in TARGETS.items() for a in attacks]
    measured_at = old.get("machine", {}).get("commit")
    by_key = {
        (r["attack"], r["target"]): scored({"commit": measured_at, **r})
        for r in old.get("rows", [])
    }
    by_key.update({(r["attack"], r["target"]): r for r in rows})
    return [by_key[k] for k in order if k in by_key]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="short windows, one aggregator")
    p.add_argument(
        "--preset",
        default=ROUTER_PRESET,
        choices=sorted(PRESETS),
        help="the aggregator's; the router's rows run at tiny only (default: tiny)",
    )
    p.add_argument(
        "--only",
        default="",
        help="attacks to run, comma-separated, each ATTACK (against every server it is run "
        "against) or ATTACK@TARGET (aggregator, router, host) (default: all)",
    )
    p.add_argument(
        "--unloaded", type=float, help="seconds unloaded per attack (25; quick 6; x deadline / 12)"
    )
    p.add_argument(
        "--attack", type=float, help="seconds attacked per attack (30; quick 8; x deadline / 12)"
    )
    p.add_argument(
        "--settle", type=float, help="seconds after each attack (5; quick 2; x deadline / 12)"
    )
    p.add_argument("--interval", type=float, default=0.25, help="seconds between honest requests")
    p.add_argument(
        "--deadline", type=float, help="the aggregator's round deadline (12; 30 past tiny)"
    )
    p.add_argument("--local-steps", type=int, default=5, help="H of the honest workers")
    p.add_argument("--factor", type=float, default=2.0, help="the latency a row tolerates")
    p.add_argument("--rss-growth-mb", type=float, default=256.0)
    p.add_argument("--warm-up", type=float, default=300.0, help="most seconds to warm up")
    p.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    args = p.parse_args()
    if args.deadline is None:
        args.deadline = 12.0 if args.preset == ROUTER_PRESET else 30.0
    scale = args.deadline / 12.0  # a window holds as many rounds at any deadline
    for name, full, quick in (("unloaded", 25.0, 6.0), ("attack", 30.0, 8.0), ("settle", 5.0, 2.0)):
        if getattr(args, name) is None:
            setattr(args, name, scale * (quick if args.quick else full))
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    known = {a for attacks in TARGETS.values() for a in attacks} | {
        f"{a}@{t}" for t, attacks in TARGETS.items() for a in attacks
    }
    if only - known:
        p.error(f"--only: unknown {sorted(only - known)}; known: {', '.join(sorted(known))}")

    def pick(target: str) -> list[str]:
        return [a for a in TARGETS[target] if not only or {a, f"{a}@{target}"} & only]

    if args.preset != ROUTER_PRESET and only and not pick("aggregator"):
        p.error(f"--only: the router's and hosts' rows run at the {ROUTER_PRESET} preset only")
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="live-attacks-") as tmp:
        agg = pick("aggregator")
        groups = [agg] if args.quick else [[a] for a in agg]
        for i, group in enumerate(g for g in groups if g):
            rows += aggregator_rows(group, args, Path(tmp) / f"aggregator-{i}")
        if (pick("router") or pick("host")) and args.preset == ROUTER_PRESET:
            rows += router_rows(pick("router"), pick("host"), args, Path(tmp))
    shape = "" if args.preset == ROUTER_PRESET else f"-{args.preset}"
    name = f"live_attacks{'-quick' if args.quick else ''}{shape}.json"
    commit = machine()["commit"]
    for r in rows:
        r["commit"] = commit
    if only:  # the rows not run this time stay, when they were measured under the same settings
        rows = merged_rows(RESULTS / name, rows, settings_of(args))
    result = {
        "command": "python bench/live_attacks.py " + " ".join(sys.argv[1:]),
        "json": name,
        "settings": settings_of(args),
        "rows": rows,
        "wall_s": time.monotonic() - t0,
        "machine": machine(),
    }
    result["command"] = result["command"].strip()
    write_json(name, result)
    if not args.quick:  # a smoke's figures are not the bench's
        update_section(f"live-attacks{shape}", markdown(result))
    print(markdown(result))
    sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
