"""Behaviour unchanged across a restructuring: the same runs at two revisions, on the same seeds,
give the same decisions and the same weights.

Each revision is checked out (detached) in benchmarks/work/equivalence/REV and run through its
own CLI (`python -m blocktrain.cli.main` with that checkout's src/ first on the path), so a pair
compares what each revision's user would have got:

- simulate: `simulate --preset tiny --workers 6 --rounds 4 --local-steps 10 --regime
  lockstep,mild --attack noise:1 --seed S`: every round's record (accepted and refused updates
  per block with their reasons, participation, from-noise CE) and the final blocks;
- train: `train --preset tiny --steps 60 --seed S`, then `eval --bytes 4096 --sweeps 4` and
  `generate --bytes 48 --seed S` of that run: the weights, the CE and the bytes generated;
- serve: that run behind one `serve-block` host and a `serve` router on loopback, one
  `POST /v1/generate` with a seed: the bytes generated (the serving rooms' path);
- cluster: `cluster --workers 6 --rounds 3 --local-steps 5` over real HTTP: each round's
  participation and CE in summary.json (less its traffic counters: they count the polls, as
  many as the wall clock allows), and the final model's weights.

Records and JSON compare equal but for wall-clock keys (WALL_KEYS); tensors by max |a - b|,
which is 0 where the two revisions run the same arithmetic on this machine (a restructuring
moves code, not arithmetic; across machines the last bits may differ, so compare on one).
Writes benchmarks/results/equivalence.json and the `equivalence` section of BENCHMARKS.md.

    python bench/equivalence.py --pair 3aa3ee6:d12ca73 --pair bf89eab:6363805
    python bench/equivalence.py --pair main:split-400 --checks simulate,train --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import load_file

from report import BLOCKTRAIN, ROOT, free_ports, machine, update_section, wait_healthy, write_json

WORK = ROOT / "benchmarks" / "work" / "equivalence"
NAME = "equivalence.json"
CHECKS = ("simulate", "train", "serve", "cluster")
WALL_KEYS = frozenset(
    {
        "wall_s",
        "elapsed_s",
        "rounds_wall_s",
        "total_s",
        "chain_s",
        "host_compute_s",
        "router_s",
        "timing",
        "started",
        "finished",
        "time",
        "compute",  # the simulator's wall seconds of training, evaluation and the rest
    }
)
"""Keys whose values are wall-clock measurements, which differ from run to run."""
PROMPT = "The history of "


def checkout(rev: str) -> tuple[str, Path]:
    """(full commit id, a detached worktree of it under WORK)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    tree = WORK / commit[:12]
    if not (tree / "src").is_dir():
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-f", str(tree), commit],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return commit, tree


class Revision:
    """One revision's CLI, run from its own checkout, writing under its own folder."""

    def __init__(self, rev: str, side: str, threads: int) -> None:
        self.commit, self.tree = checkout(rev)
        # by side too: a pair of one revision twice checks that the runs repeat at all
        self.runs = WORK / "runs" / f"{side}-{self.commit[:12]}"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(self.tree / "src"),
            "OMP_NUM_THREADS": str(threads),
        }

    def fresh(self, name: str) -> Path:
        """An output folder of this revision, emptied (the CLI refuses to overwrite some)."""
        out = self.runs / name
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        return out

    def neutral(self, value: Any) -> Any:
        return neutral(value, {str(self.runs): "RUNS", str(self.tree): "TREE"})

    def cli(self, argv: list[str]) -> str:
        print(f"$ [{self.commit[:8]}] blocktrain " + " ".join(argv), file=sys.stderr, flush=True)
        return subprocess.run(
            [*BLOCKTRAIN, *argv],
            cwd=self.tree,
            env=self.env,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout

    def spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*BLOCKTRAIN, *argv],
            cwd=self.tree,
            env=self.env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )


def neutral(value: Any, names: dict[str, str]) -> Any:
    """A JSON value with a revision's folders (`names`: path -> name) and loopback ports named
    alike for both revisions."""
    text = json.dumps(value)
    for path, name in names.items():
        text = text.replace(path, name)
    return json.loads(re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text))


def without_wall(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_wall(v) for k, v in value.items() if k not in WALL_KEYS}
    if isinstance(value, list):
        return [without_wall(v) for v in value]
    return value


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ (wall-clock keys left out), at most a few paths."""
    a, b = without_wall(a), without_wall(b)
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only on one side" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out[:5]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}[{i}]")
        ][:5]
    return [] if a == b else [f"{path or '.'}: {json.dumps(a)[:60]} != {json.dumps(b)[:60]}"]


def tensor_gap(a: Path, b: Path) -> float:
    """max |a - b| over the safetensors files both folders hold (by relative path); inf if
    their files, names or shapes differ."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    files_b = sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    if not files_a or files_a != files_b:
        return float("inf")
    gap = 0.0
    for rel in files_a:
        ta, tb = load_file(a / rel), load_file(b / rel)
        if ta.keys() != tb.keys() or any(ta[k].shape != tb[k].shape for k in ta):
            return float("inf")
        for k in ta:
            gap = max(
                gap, float((ta[k].double() - tb[k].double()).abs().max()) if ta[k].numel() else 0.0
            )
    return gap


def jsonl(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def simulate(r: Revision, seed: int) -> dict[str, Any]:
    out = r.fresh(f"simulate-{seed}")
    report = json.loads(
        r.cli(
            [
                "simulate",
                "--preset",
                "tiny",
                "--workers",
                "6",
                "--rounds",
                "4",
                "--local-steps",
                "10",
                "--regime",
                "lockstep,mild",
                "--attack",
                "noise:1",
                "--seed",
                str(seed),
                "--out",
                str(out),
                "--final-sweeps",
                "4",
                "--final-bytes",
                "4096",
                "--json",
            ]
        )
    )
    records = {p.parent.name: jsonl(p) for p in sorted(out.glob("*/rounds.jsonl"))}
    return {"out": out, "json": {"report": report, "records": records}}


def train(r: Revision, seed: int) -> dict[str, Any]:
    out = r.fresh(f"train-{seed}")
    r.cli(
        [
            "train",
            "--preset",
            "tiny",
            "--steps",
            "60",
            "--seed",
            str(seed),
            "--out",
            str(out),
            "--overwrite",
            "--json",
        ]
    )
    ce = json.loads(r.cli(["eval", str(out), "--bytes", "4096", "--sweeps", "4", "--json"]))
    text = r.cli(["generate", str(out), "--prompt", PROMPT, "--bytes", "48", "--seed", str(seed)])
    return {"out": out, "json": {"eval": ce, "generate": text}}


def serve(r: Revision, seed: int) -> dict[str, Any]:

    run = r.runs / f"train-{seed}"
    if not run.is_dir():
        train(r, seed)
    host_port, router_port = free_ports(2)
    host_url, router_url = f"http://127.0.0.1:{host_port}", f"http://127.0.0.1:{router_port}"
    procs = [
        r.spawn(
            ["serve-block", str(run), "--blocks", "0,1,2", "--port", str(host_port)],
            r.runs / f"host-{seed}.log",
        )
    ]
    try:
        wait_healthy(host_url, procs)
        procs.append(
            r.spawn(
                ["serve", "--hosts", host_url, "--port", str(router_port)],
                r.runs / f"router-{seed}.log",
            )
        )
        wait_healthy(router_url, procs)
        reply = httpx.post(
            f"{router_url}/v1/generate",
            timeout=120,
            json={"prompt": PROMPT, "max_bytes": 32, "seed": seed, "temperature": 1.0},
        )
        reply.raise_for_status()
        text = reply.json()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    return {"out": None, "json": {"text": text.get("text"), "model": text.get("model")}}


def cluster(r: Revision, seed: int) -> dict[str, Any]:
    out = r.fresh(f"cluster-{seed}")
    r.cli(
        [
            "cluster",
            "--workers",
            "6",
            "--preset",
            "tiny",
            "--rounds",
            "3",
            "--local-steps",
            "5",
            "--seed",
            str(seed),
            "--out",
            str(out),
            "--overwrite",
            "--threads",
            "1",
            "--eval-bytes",
            "2048",
            "--eval-sweeps",
            "2",
            "--final-bytes",
            "4096",
            "--final-sweeps",
            "4",
            "--json",
        ]
    )
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("bytes")  # counts the status and round polls too, as many as the wall clock allows
    return {"out": out / "model", "json": summary}


RUNNERS = {"simulate": simulate, "train": train, "serve": serve, "cluster": cluster}


def compare(before: Revision, after: Revision, check: str, seed: int) -> dict[str, Any]:
    started = time.monotonic()
    a, b = RUNNERS[check](before, seed), RUNNERS[check](after, seed)
    diffs = differences(before.neutral(a["json"]), after.neutral(b["json"]))
    gap = None if a["out"] is None else tensor_gap(a["out"], b["out"])
    return {
        "before": before.commit,
        "after": after.commit,
        "check": check,
        "seed": seed,
        "same_records": not diffs,
        "differences": diffs,
        "max_weight_gap": gap,
        "wall_s": time.monotonic() - started,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"`{result['command']}` on {result['machine'].get('cpu', '?')}. Each row runs one check "
        "at both revisions on one seed; records: every decision and CE the check writes, "
        "wall-clock keys left out; weight gap: max |before - after| over every tensor saved.",
        "",
        "| before | after | check | seed | records | weight gap | differences |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for row in result["rows"]:
        gap = row["max_weight_gap"]
        lines.append(
            f"| {row['before'][:8]} | {row['after'][:8]} | {row['check']} | {row['seed']} | "
            f"{'same' if row['same_records'] else 'differ'} | {'—' if gap is None else f'{gap:.3g}'} | "
            f"{'; '.join(row['differences']) or '—'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--pair",
        action="append",
        required=True,
        metavar="BEFORE:AFTER",
        help="two revisions (commits, branches, tags) to compare; repeatable",
    )
    p.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"comma-separated checks (default: {','.join(CHECKS)})",
    )
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default: 0,1)")
    p.add_argument("--threads", type=int, default=2, help="threads of each run (default: 2)")
    args = p.parse_args()
    checks = [c for c in args.checks.split(",") if c]
    if unknown := set(checks) - set(RUNNERS):
        p.error(f"unknown checks: {', '.join(sorted(unknown))} (choose from {', '.join(CHECKS)})")
    pairs = []
    for pair in args.pair:
        before, sep, after = pair.partition(":")
        if not sep or not before or not after:
            p.error(f"--pair {pair!r}: expected BEFORE:AFTER")
        pairs.append(
            (Revision(before, "before", args.threads), Revision(after, "after", args.threads))
        )
    rows = [
        compare(b, a, check, int(seed))
        for b, a in pairs
        for check in checks
        for seed in args.seeds.split(",")
    ]
    result = {
        "command": "python bench/equivalence.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "rows": rows,
    }
    write_json(NAME, result)
    update_section("equivalence", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
