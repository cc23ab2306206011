"""Behaviour unchanged across a restructuring: the same runs at two revisions, on the same seeds,
give the same decisions and the same weights.

Each revision is checked out (detached) in benchmarks/work/equivalence/REV and run through its
own CLI (`python -m blocktrain.cli.main` with that checkout's src/ first on the path), so a pair
compares what each revision's user would have got:

- simulate: `simulate --preset tiny --workers 6 --rounds 4 --local-steps 10 --regime
  lockstep,mild --attack noise:1 --seed S` (`--set attack=noise:1` since issue 57): every round's record (accepted and refused updates
  per block with their reasons, participation, from-noise CE) and the final blocks;
- train: `train --preset tiny --steps 60 --seed S`, then `eval --bytes 4096 --sweeps 4` and
  `generate --bytes 48 --seed S` of that run: the weights, the CE and the bytes generated;
- serve: that run behind one `serve-block` host and a `serve` router on loopback, one
  `POST /v1/generate` with a seed: the bytes generated (the serving rooms' path);
- cluster: `cluster --workers 6 --rounds 3 --local-steps 5` over real HTTP: each round's
  participation and CE in summary.json (less its traffic counters: they count the polls, as
  many as the wall clock allows), and the final model's weights;
- frontier: the revision's own `bench/span_frontier.py --quality-only`, small (FRONTIER: the
  judge and each model 60 steps, K = 1 and 4, 4 prompts): every quality row (gen_ce, floor_ce,
  entropy, joint_ce, the samples) and every model it trained. Its seeds are its own.

Records and JSON compare equal but for wall-clock keys (WALL_KEYS); tensors by max |a - b|,
which is 0 where the two revisions run the same arithmetic on this machine (a restructuring
moves code, not arithmetic; across machines the last bits may differ, so compare on one).
Writes benchmarks/results/equivalence.json and the `equivalence` section of BENCHMARKS.md.

    python bench/equivalence.py --pair 3aa3ee6:d12ca73 --pair bf89eab:6363805
    python bench/equivalence.py --pair bf89eab:6363805 --checks frontier --seeds 0
    python bench/equivalence.py --pair main:split-400 --checks simulate,train --seeds 0
    python bench/equivalence.py --pair 3aa3ee6:d12ca73 --checks cluster --reread  # no runs

The JSON keeps the rows of every pair, check and seed run so far; a new call replaces its own.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import load_file

from report import (
    BLOCKTRAIN,
    RESULTS,
    ROOT,
    free_ports,
    machine,
    update_section,
    wait_healthy,
    write_json,
)

WORK = ROOT / "benchmarks" / "work" / "equivalence"
NAME = "equivalence.json"
WALL_KEYS = frozenset(
    {
        "wall_s",
        "wall_seconds",
        "duration_s",  # a cluster round's, from its first pull to its commit
        "compute",  # the simulator's wall seconds of training, evaluation and the rest
    }
)
"""Keys whose values are wall-clock measurements, which differ from run to run."""
Output = tuple[Path | None, Any]
"""What a check compares: the folder of the tensors it saved (None: none), and its JSON."""
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

    def knows(self, flag: str, command: str) -> bool:
        """Whether its `blocktrain COMMAND` takes `flag` (knobs moved behind `--set` over time)."""
        return (
            f'"{flag}"' in (self.tree / "src" / "blocktrain" / "cli" / f"{command}.py").read_text()
        )

    def script(self, argv: list[str]) -> None:
        """Run one of this revision's own bench scripts, from its checkout."""
        print(f"$ [{self.commit[:8]}] python " + " ".join(argv), file=sys.stderr, flush=True)
        subprocess.run([sys.executable, *argv], cwd=self.tree, env=self.env, check=True)

    def spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:  # the child holds its own copy of the descriptor
            return subprocess.Popen(
                [*BLOCKTRAIN, *argv],
                cwd=self.tree,
                env=self.env,
                stdout=out,
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


def differences(a: Any, b: Any) -> list[str]:
    """Where two JSON values differ (wall-clock keys left out), at most a few paths."""
    return _differences(without_wall(a), without_wall(b), "")


def _differences(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only on one side" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += _differences(a[k], b[k], f"{path}.{k}")
        return out[:5]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}[{i}]")
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


SIMULATE = "simulate --preset tiny --workers 6 --rounds 4 --local-steps 10 --regime lockstep,mild"
SIMULATE += " --final-sweeps 4 --final-bytes 4096 --json"
ATTACK = "noise:1"  # `--attack` before issue 57 moved it behind `--set attack=`
TRAIN = "train --preset tiny --steps 60 --overwrite --json"
EVAL = "--bytes 4096 --sweeps 4 --json"
CLUSTER = "cluster --workers 6 --preset tiny --rounds 3 --local-steps 5 --overwrite --threads 1"
CLUSTER += " --eval-bytes 2048 --final-bytes 4096 --final-sweeps 4 --json"  # M = 2 per round


def simulate(r: Revision, seed: int) -> None:
    out = r.fresh(f"simulate-{seed}")
    attack = (
        ["--attack", ATTACK] if r.knows("--attack", "simulate") else ["--set", f"attack={ATTACK}"]
    )
    r.cli([*SIMULATE.split(), *attack, "--seed", str(seed), "--out", str(out)])


def read_simulate(r: Revision, seed: int) -> Output:
    out = r.runs / f"simulate-{seed}"
    records = {p.parent.name: jsonl(p) for p in sorted(out.glob("*/rounds.jsonl"))}
    report = json.loads((out / "simulate.json").read_text())  # what --json prints, kept
    return out, {"report": report, "records": records}


def train(r: Revision, seed: int) -> None:
    out = r.fresh(f"train-{seed}")
    r.cli([*TRAIN.split(), "--seed", str(seed), "--out", str(out)])
    (out / "eval.json").write_text(r.cli(["eval", str(out), *EVAL.split()]))
    text = r.cli(["generate", str(out), "--prompt", PROMPT, "--bytes", "48", "--seed", str(seed)])
    (out / "generated.txt").write_text(text)


def read_train(r: Revision, seed: int) -> Output:
    out = r.runs / f"train-{seed}"
    ce = json.loads((out / "eval.json").read_text())
    return out, {"eval": ce, "generate": (out / "generated.txt").read_text()}


def serve(r: Revision, seed: int) -> None:
    """One host holding every block of the train check's run, a router, one seeded request."""
    run = r.runs / f"train-{seed}"
    if not (run / "generated.txt").exists():
        train(r, seed)
    host_port, router_port = free_ports(2)
    host_url, router_url = f"http://127.0.0.1:{host_port}", f"http://127.0.0.1:{router_port}"
    host = ["serve-block", str(run), "--blocks", "0,1,2", "--port", str(host_port)]
    procs = [r.spawn(host, r.runs / f"host-{seed}.log")]
    try:
        wait_healthy(host_url, procs)
        router = ["serve", "--hosts", host_url, "--port", str(router_port)]
        procs.append(r.spawn(router, r.runs / f"router-{seed}.log"))
        wait_healthy(router_url, procs)
        request = {"prompt": PROMPT, "max_bytes": 32, "seed": seed, "temperature": 1.0}
        reply = httpx.post(f"{router_url}/v1/generate", timeout=120, json=request)
        reply.raise_for_status()
        (r.runs / f"serve-{seed}.json").write_text(reply.text)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def read_serve(r: Revision, seed: int) -> Output:
    reply = json.loads((r.runs / f"serve-{seed}.json").read_text())
    return None, {"text": reply["text"], "model": reply["model"]}


def cluster(r: Revision, seed: int) -> None:
    out = r.fresh(f"cluster-{seed}")
    r.cli([*CLUSTER.split(), "--seed", str(seed), "--out", str(out)])


def read_cluster(r: Revision, seed: int) -> Output:
    out = r.runs / f"cluster-{seed}"
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("bytes")  # counts the status and round polls too, as many as the wall clock allows
    # which process registers first, and so which worker id holds which block, is a race: the
    # workers are compared as a set, less the bytes their status polls add
    summary["workers_report"] = sorted(
        (
            {k: v for k, v in w.items() if k not in ("worker_id", "bytes_down")}
            for w in summary["workers_report"]
        ),
        key=lambda w: json.dumps(w, sort_keys=True),
    )
    return out / "model", summary


FRONTIER = "bench/span_frontier.py --quality-only --preset tiny --spans 1,4 --recipes default"
FRONTIER += " --samplers euler --drafters ngram --judge-steps 60 --steps 60 --prompts 4 --sweeps 2"
FRONTIER += " --joint-bytes 2048 --name equivalence_frontier"
"""The frontier's quality rows, small: the judge and every model 60 steps, 4 prompts."""


def frontier(r: Revision, seed: int) -> None:
    """The revision's own bench/span_frontier.py (its seeds are its own: `seed` is unused). It
    writes inside the checkout, which both sides of a pair of one revision share, so what it
    wrote moves to this side's folder."""
    models = r.tree / "benchmarks" / "work" / "span_frontier"
    shutil.rmtree(models, ignore_errors=True)
    r.script(FRONTIER.split())
    out = r.fresh("frontier")
    shutil.move(models, out / "models")
    shutil.move(r.tree / "benchmarks" / "results" / "equivalence_frontier.json", out)


def read_frontier(r: Revision, seed: int) -> Output:
    out = r.runs / "frontier"
    result = json.loads((out / "equivalence_frontier.json").read_text())
    result.pop("machine")  # names the revision's own commit
    return out / "models", result


CHECKS: dict[str, tuple[Callable[[Revision, int], None], Callable[[Revision, int], Output]]] = {
    "simulate": (simulate, read_simulate),
    "train": (train, read_train),
    "serve": (serve, read_serve),
    "cluster": (cluster, read_cluster),
    "frontier": (frontier, read_frontier),
}
"""Each check's run (writing under the revision's folder) and its reading of what it wrote."""


def compare(
    before: Revision, after: Revision, check: str, seed: int, reread: bool = False
) -> dict[str, Any]:
    started = time.monotonic()
    run, read = CHECKS[check]
    if not reread:
        run(before, seed)
        run(after, seed)
    (tensors_a, a), (tensors_b, b) = read(before, seed), read(after, seed)
    diffs = differences(before.neutral(a), after.neutral(b))
    gap = None if tensors_a is None or tensors_b is None else tensor_gap(tensors_a, tensors_b)
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
        f"`{result['command']} --pair BEFORE:AFTER` on {result['machine'].get('cpu', '?')}. "
        "Each row runs one check at both revisions on one seed; records: every decision and CE "
        "the check writes, wall-clock keys left out; weight gap: max |before - after| over every "
        "tensor saved (0: the same bits).",
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
    p.add_argument(
        "--reread",
        action="store_true",
        help="compare what the runs of an earlier call left on disk, without running",
    )
    args = p.parse_args()
    checks = [c for c in args.checks.split(",") if c]
    if unknown := set(checks) - set(CHECKS):
        p.error(f"unknown checks: {', '.join(sorted(unknown))} (choose from {', '.join(CHECKS)})")
    pairs = []
    for pair in args.pair:
        before, sep, after = pair.partition(":")
        if not sep or not before or not after:
            p.error(f"--pair {pair!r}: expected BEFORE:AFTER")
        pairs.append(
            (Revision(before, "before", args.threads), Revision(after, "after", args.threads))
        )
    path = RESULTS / NAME
    saved = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = {key_of(r): r for r in saved}  # the rows of other pairs, checks and seeds are kept
    for b, a in pairs:
        for check in checks:
            for seed in args.seeds.split(","):
                row = compare(b, a, check, int(seed), reread=args.reread)
                if args.reread and key_of(row) in rows:  # the time the runs took, not the reading
                    row["wall_s"] = rows[key_of(row)]["wall_s"]
                rows[key_of(row)] = row
    result = {
        "command": "python bench/equivalence.py",
        "machine": machine(),
        "rows": list(rows.values()),
    }
    write_json(NAME, result)
    update_section("equivalence", markdown(result))
    print(markdown(result))


def key_of(row: dict[str, Any]) -> tuple[str, str, str, int]:
    return row["before"], row["after"], row["check"], row["seed"]


if __name__ == "__main__":
    main()
