"""A whole decentralised run on this machine: the aggregator and N `blocktrain` worker
subprocesses over real HTTP. This module only starts, watches and stops processes; the caller
prepares the state folder and evaluates the result."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from blocktrain.errors import ProtocolError
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.retrying import RetryPolicy
from blocktrain.tls import is_loopback

log = logging.getLogger(__name__)

BLOCKTRAIN = [sys.executable, "-m", "blocktrain.cli.main"]
"""How a subprocess runs the CLI (the same interpreter and package as this process)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    files: list[IO[bytes]] = field(default_factory=list)

    def close_files(self) -> None:
        for f in self.files:
            with contextlib.suppress(OSError):
                f.close()


def spawn(
    name: str,
    argv: Sequence[str],
    logs: Path,
    *,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> Proc:
    """Start `prefix + argv` with stdout/stderr in logs/NAME.out and logs/NAME.log."""
    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / f"{name}.out", logs / f"{name}.log"
    out, err = open(out_path, "wb"), open(err_path, "wb")  # noqa: SIM115 - closed by Proc
    popen = subprocess.Popen(
        [*prefix, *argv],
        stdout=out,
        stderr=err,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    return Proc(name, popen, out_path, err_path, [out, err])


def wait_for_endpoint(state: StateDir, proc: Proc, timeout_s: float = 60.0) -> str:
    """The URL the aggregator process wrote once it listens."""
    limit = time.monotonic() + timeout_s
    while time.monotonic() < limit:
        doc = state.read_endpoint()
        if doc is not None and doc.get("pid") == proc.popen.pid:
            return str(doc["url"])
        if proc.popen.poll() is not None:
            raise ProtocolError(
                f"the aggregator exited with code {proc.popen.returncode}: {tail(proc.stderr)}"
            )
        time.sleep(0.05)
    raise ProtocolError(f"the aggregator did not start listening within {timeout_s:.0f}s")


def start_aggregator(
    state: StateDir,
    logs: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    extra: Sequence[str] = (),
    name: str = "aggregator",
    prefix: Sequence[str] = (),
) -> tuple[Proc, str]:
    """The aggregator of `state` on host:port (off loopback: the private network namespaces
    of the benches and tests, over plain HTTP, `--insecure-http`)."""
    state.clear_endpoint()
    insecure = [] if is_loopback(host) else ["--insecure-http"]
    proc = spawn(
        name,
        [
            *BLOCKTRAIN,
            "aggregator",
            "--state",
            str(state.root),
            "--host",
            host,
            "--port",
            str(port),
            *insecure,
            *extra,
        ],
        logs,
        prefix=prefix,
    )
    return proc, wait_for_endpoint(state, proc)


def worker_argv(
    url: str,
    *,
    name: str,
    data: str | None,
    threads: int = 1,
    device: str | None = None,
    extra: Sequence[str] = (),
    data_patterns: Sequence[str] = (),
) -> list[str]:
    """The command line of one of a cluster's workers (`device`: its --device, else auto)."""
    argv = [
        *BLOCKTRAIN,
        "worker",
        "--aggregator",
        url,
        "--name",
        name,
        "--threads",
        str(threads),
        "--json",
        *(["--device", device] if device else []),
        *extra,
    ]
    if data:
        argv += ["--data", data]
    return argv + list(data_patterns)  # --glob, for the files of a --data folder


def start_worker(
    url: str, token: str, logs: Path, *, prefix: Sequence[str] = (), **options: Any
) -> Proc:
    """One of a cluster's workers, started (`options`: `worker_argv`'s)."""
    argv = worker_argv(url, **options)
    return spawn(options["name"], argv, logs, env={"BLOCKTRAIN_TOKEN": token}, prefix=prefix)


def stop(procs: Sequence[Proc], grace_s: float = 20.0) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL whatever is left (each by its own pid)."""
    for p in procs:
        if p.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
    limit = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=max(0.0, limit - time.monotonic()))
        if p.popen.poll() is None:
            log.warning("%s did not stop on SIGTERM; killing it", p.name)
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()
            p.popen.wait(timeout=10)
        p.close_files()


def tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def worker_report(proc: Proc) -> dict[str, Any] | None:
    """The JSON report a worker printed at exit (None if it printed none)."""
    try:
        return dict(json.loads(proc.stdout.read_text()))
    except (OSError, ValueError):
        return None


@dataclass
class ClusterResult:
    status: dict[str, Any]
    workers: list[dict[str, Any] | None]
    exit_codes: dict[str, int | None]
    wall_seconds: float
    url: str


class LocalCluster:
    """The aggregator and one worker process per token, in steps, so that the caller can work
    while the aggregator still serves after the rounds (`start`, `wait_rounds`, then the `with`
    block stops every process). The state's settings must set max_rounds."""

    def __init__(
        self,
        state: StateDir,
        tokens: Sequence[str],
        observer_token: str,
        logs: Path,
        *,
        data: str | None,
        data_patterns: Sequence[str] = (),
        threads: int = 1,
        timeout_s: float = 3600.0,
        host: str = "127.0.0.1",
        devices: Sequence[str] = (),
    ) -> None:
        if state.settings().max_rounds is None:
            raise ProtocolError("a cluster run needs max_rounds in the aggregator settings")
        self.state, self.tokens = state, tokens
        self.observer_token, self.logs = observer_token, logs
        self.data, self.data_patterns, self.threads = data, data_patterns, threads
        self.timeout_s, self.host = timeout_s, host
        self.devices = list(devices)
        """Worker i's --device: devices[i % len(devices)]; none given: each worker's auto."""
        self.aggregator: Proc | None = None
        self.workers: list[Proc] = []
        self.client: AggregatorClient | None = None
        self.url = ""
        self.started = time.monotonic()
        self.rounds_seconds: float | None = None
        """Seconds from `start` until the rounds ended and the workers exited."""

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> str:
        """Start the aggregator, then the workers; the aggregator's URL."""
        self.started = time.monotonic()
        # the aggregator's effect probe reads it
        probe_data = ["--data", self.data, *self.data_patterns] if self.data else []
        # every worker runs on this machine, from one address: no share per address below the cap
        one_address = ["--set", "max_connections_per_address=512"]
        self.aggregator, self.url = start_aggregator(
            self.state, self.logs, host=self.host, extra=[*probe_data, *one_address]
        )
        self.client = AggregatorClient(
            self.url,
            self.observer_token,
            retry=RetryPolicy(base_s=0.2, cap_s=2.0, give_up_after_s=60.0),
        )
        for i, token in enumerate(self.tokens):
            self.workers.append(
                start_worker(
                    self.url,
                    token,
                    self.logs,
                    name=f"worker-{i}",
                    data=self.data,
                    threads=self.threads,
                    device=self.devices[i % len(self.devices)] if self.devices else None,
                    data_patterns=self.data_patterns,
                )
            )
        return self.url

    def wait_rounds(
        self, on_status: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Wait until every block is done (or raise after `timeout_s`, or when the aggregator,
        or every worker, exits early), then for the workers to exit; the final status, with
        every round. The aggregator keeps serving."""
        assert self.client is not None and self.aggregator is not None, "start() first"
        client, aggregator, workers = self.client, self.aggregator, self.workers
        status = client.status()
        while not status["done"]:
            if time.monotonic() - self.started > self.timeout_s:
                raise ProtocolError(
                    f"the cluster did not finish within {self.timeout_s:.0f}s "
                    f"(rounds {status['rounds']}); see {self.logs}"
                )
            if aggregator.popen.poll() is not None:
                raise ProtocolError(f"the aggregator exited early: {tail(aggregator.stderr)}")
            if all(w.popen.poll() is not None for w in workers):
                raise ProtocolError(
                    f"every worker exited before the end; e.g. {tail(workers[0].stderr)}"
                )
            time.sleep(1.0)
            status = client.status()
            if on_status is not None:
                on_status(status)
        # the workers see `done` on their next poll and exit by themselves
        limit = time.monotonic() + 60.0
        while time.monotonic() < limit and any(w.popen.poll() is None for w in workers):
            time.sleep(0.2)
        stop(workers)
        self.rounds_seconds = time.monotonic() - self.started
        return dict(client._json("GET", "/v1/status", params={"rounds": 100_000}))

    def close(self) -> None:
        """Stop whatever still runs: the workers, then the aggregator."""
        if self.client is not None:
            self.client.close()
        stop(self.workers)
        if self.aggregator is not None:
            stop([self.aggregator])

    def exit_codes(self) -> dict[str, int | None]:
        """Each process's exit code (None: it still runs)."""
        procs = ([self.aggregator] if self.aggregator is not None else []) + self.workers
        return {p.name: p.popen.poll() for p in procs}

    def worker_reports(self) -> list[dict[str, Any] | None]:
        return [worker_report(w) for w in self.workers]


def run_cluster(
    state: StateDir,
    tokens: Sequence[str],
    observer_token: str,
    logs: Path,
    *,
    on_status: Callable[[dict[str, Any]], None] | None = None,
    **options: Any,
) -> ClusterResult:
    """Start the aggregator and one worker per token (`LocalCluster`'s `options`); wait until
    every block is done or `timeout_s`; stop everything."""
    with LocalCluster(state, tokens, observer_token, logs, **options) as cluster:
        url = cluster.start()
        status = cluster.wait_rounds(on_status)
    return ClusterResult(
        status=status,
        workers=cluster.worker_reports(),
        exit_codes=cluster.exit_codes(),
        wall_seconds=time.monotonic() - cluster.started,
        url=url,
    )
