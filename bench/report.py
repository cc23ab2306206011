"""Shared by the bench scripts: where results go, the tables in BENCHMARKS.md, and the
scaffolding of a run: the CLI as a subprocess, trained runs reused, free ports, a server's health."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.protocol.store.state import create_state
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.training import Trainer
from blocktrain.training.flops import FlopCount, count_flops
from blocktrain.training.local import initial_blocks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
RESEARCH = ROOT / "docs" / "research"  # history: research that ended, figures superseded


BLOCKTRAIN = [sys.executable, "-m", "blocktrain.cli.main"]


def blocktrain(argv: list[str]) -> str:
    """Run `blocktrain ARGV` from the repository root, echoing the command; its stdout."""
    print("$ blocktrain " + " ".join(argv), file=sys.stderr, flush=True)
    return subprocess.run(
        [*BLOCKTRAIN, *argv], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True
    ).stdout


def blocktrain_json(argv: list[str]) -> dict[str, Any]:
    """`blocktrain ARGV` (a command given `--json`): its report, parsed."""
    return dict(json.loads(blocktrain(argv)))


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open together while they are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_healthy(url: str, procs: list[subprocess.Popen[Any]], timeout_s: float = 180) -> None:
    """Wait until `URL/healthz` answers 200; fail at once if one of `procs` (the servers
    started for it) exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a server exited with {p.returncode} ({p.args!r})")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not come up in {timeout_s} s")


def trained(run: Path, argv: list[str], command: str = "train") -> Path:
    """Run `blocktrain COMMAND` (train, or distill) with `argv` into `run` to its configured
    steps, resuming it, or reuse it when done. A folder killed before its first checkpoint
    (a config, no state) holds no progress and is started over."""
    state = run / "state.json"
    if state.exists():
        steps = json.loads((run / "config.json").read_text())["train"]["steps"]
        if json.loads(state.read_text())["step"] < steps:
            blocktrain([command, "--resume", "--out", str(run), "--no-progress"])
        return run
    fresh = ["--overwrite"] if (run / "config.json").exists() else []
    blocktrain([command, *argv, *fresh, "--out", str(run), "--no-progress"])
    return run


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }


def add_simulated_row_args(p: argparse.ArgumentParser) -> None:
    """The flags of a bench whose rows are simulator runs of the same length and seed, kept in
    its JSON (a row already there is skipped unless --force)."""
    p.add_argument("--rounds", type=int, default=10, help="rounds per block, every row")
    p.add_argument("--local-steps", type=int, default=10, help="H, every row")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--force", action="store_true", help="re-run the rows asked for, though in the JSON"
    )
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")


@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Hold the lock NAME (a file under benchmarks/work/, kept out of git) for a read, change
    and write of a shared file, so that bench processes running side by side lose nothing."""
    path = ROOT / "benchmarks" / "work" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def update_section(name: str, markdown: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in `path`
    (appending the section if it is not there yet)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    with exclusive(path.name):  # two benches may write their sections of one file at once
        text = path.read_text() if path.exists() else "# Benchmarks\n"
        text = (
            pattern.sub(lambda _: block, text)
            if pattern.search(text)
            else (text.rstrip() + "\n\n" + block + "\n")
        )
        path.write_text(text)


def forward_flops(trainer: Trainer, source: ByteSource) -> FlopCount:
    """FLOPs of one forward pass of every unit of `trainer` (its loss, in its precision) on one
    batch of `source`, counted as the code runs."""
    cfg = trainer.cfg
    x = source.sample(cfg.train.batch_size, cfg.model.seq_len, torch.Generator().manual_seed(0))
    x = x.to(trainer.device)

    def forward() -> None:
        with torch.no_grad(), trainer.autocast():
            for unit in trainer.units:
                unit.objective(x, torch.Generator(trainer.device).manual_seed(0))

    return count_flops(forward)


def train_flops_per_step(trainer: Trainer, source: ByteSource) -> int:
    """Training FLOPs of one step of `trainer`: 3 x forward (the backward costs twice it)."""
    return 3 * forward_flops(trainer, source).total


def cluster_state(
    root: Path, cfg: RunConfig, settings: dict[str, Any], workers: int
) -> tuple[StateDir, list[str], str]:
    """A new aggregator state folder for `cfg` (version 0: fresh blocks), a bearer token for
    each of `workers` workers (named worker-I) and one for the bench's own status polls."""
    state = create_state(root, cfg, settings, initial_blocks(cfg))
    tokens = [new_token() for _ in range(workers)]
    for i, token in enumerate(tokens):
        state.ledger.add_token(f"worker-{i}", hash_token(token), time.time())
    observer = new_token()
    state.ledger.add_token("observer", hash_token(observer), time.time())
    return state, tokens, observer
