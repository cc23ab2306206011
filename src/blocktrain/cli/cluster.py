"""`blocktrain cluster`: a decentralised run on this machine: the aggregator and N worker
processes over real HTTP on loopback, then the from-noise CE of every round's committed model.

Writes OUT/state (the aggregator's state folder, every version kept), OUT/logs (one log per
process: each worker's says what each of its rounds did), OUT/model (the final assembled run
folder, for `blocktrain eval` and `generate`), OUT/viewer.token and OUT/summary.json: rounds,
participation per block, bytes moved against the minimum, from-noise CE per round, final CE.
The aggregator's defaults are a public aggregator's (the effect probe and every other defence
on: at the small shape they accepted every honest update, BENCHMARKS.md, Poisoning), but rounds
have a 60 s deadline unless `--deadline`, and no minimum round length; a `--reference` (DiLoCo)
cluster runs without the probe, which judges blocks.

At the start it prints the aggregator's dashboard URL with a viewer token (one that may only
watch: `blocktrain token add --viewer`) in its fragment, and the token itself. While the rounds
run, the aggregator evaluates the assembled model after every round (--set live_eval_every=1; the first
live_eval_bytes of the validation split, M = live_eval_sweeps, in the background) and the
dashboard plots that validation CE beside the workers' reported loss. The dashboard stays up
through the evaluation after the rounds (each round's model, then the final one, with progress
on stderr), and with --keep-dashboard until Ctrl-C:

  cluster: 3 workers on http://127.0.0.1:41523 (on cpu; logs in runs/c3/logs)
  cluster: dashboard http://127.0.0.1:41523/dashboard#token=bt_...
  cluster: viewer token bt_... (in runs/c3/viewer.token; it may only watch: blocktrain status
      http://127.0.0.1:41523 --token-file runs/c3/viewer.token)
  cluster: rounds done in 212s; every worker has left
  cluster: evaluating 11 models, the first and the one after each round (8192 bytes, M = 2);
      the dashboard stays up until the evaluation ends
  cluster: after round 0 of 10: from-noise CE 5.545     (where no bar is drawn, unless -q)
  ...
  cluster: final evaluation of runs/c3/model (32768 bytes, M = 16)

With --log-to the committed rounds (as the status lists them) and the evaluations go to
TensorBoard, W&B or MLflow too, under OUT, at step = the rounds done (cli/cluster_eval.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from blocktrain.cli.cluster_eval import evaluate_cluster, evaluation_records, round_records, say
from blocktrain.cli.common import (
    Formatter,
    add_config_args,
    add_data_arg,
    add_device_arg,
    add_log_arg,
    add_progress_arg,
    add_setting_args,
    add_unit_arg,
    file_patterns,
    log_backends,
    print_json,
    progress_bar,
    resolve_rounds_config,
    settings_overrides,
    unit_of,
)
from blocktrain.data import load_split, resolve_data_path
from blocktrain.data.provenance import corpus_record, write_record
from blocktrain.device import spread_devices
from blocktrain.errors import ConfigError
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.protocol.ops.cluster import LocalCluster
from blocktrain.protocol.store.state import create_state
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.training.local import (
    initial_units,
    reference_config,
)
from blocktrain.training.tracking import Tracking, remove_outputs

EXAMPLES = """examples:
  blocktrain cluster --workers 6 --preset tiny --rounds 30 --out runs/cluster
  blocktrain cluster --workers 3 --preset tiny --rounds 10 --local-steps 20 --deadline 30 \\
      --out runs/c3 --set d_model=64
  blocktrain cluster --workers 3 --preset tiny --rounds 10 --out runs/c3 --keep-dashboard
  blocktrain cluster --workers 3 --preset tiny --rounds 10 --out runs/c3 --log-to tensorboard
  blocktrain cluster --workers 4 --preset tiny --rounds 10 --out runs/c4 --gpus all  # 1 per GPU
  blocktrain eval runs/cluster/model --split test
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster",
        help="run an aggregator and N workers on this machine",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("--workers", type=int, required=True, metavar="N", help="worker processes")
    add_config_args(p)
    add_unit_arg(p)
    add_data_arg(p)
    p.add_argument("--rounds", type=int, required=True, metavar="R", help="rounds per block")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--seed", type=int, help="run seed (overrides the preset)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    add_device_arg(p)
    p.add_argument(
        "--gpus",
        metavar="N",
        help="spread the workers round-robin over cuda:0..N-1 (N or all: every GPU torch "
        "sees), each worker process on its own --device cuda:i, and evaluate on cuda:0; "
        "fewer GPUs than N, or none, exits 2 before anything is written",
    )
    p.add_argument(
        "--eval-bytes", type=int, default=8192, help="validation bytes for the per-round CE"
    )
    p.add_argument(
        "--final-bytes",
        type=int,
        default=32768,
        help="validation bytes for the final CE (as `blocktrain eval`)",
    )
    p.add_argument("--final-sweeps", type=int, default=16, help="sweeps M for the final CE")
    p.add_argument(
        "--timeout", type=float, default=3600.0, metavar="S", help="give up after S seconds"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument(
        "--keep-dashboard",
        action="store_true",
        help="keep the aggregator and its dashboard up after the evaluation, until Ctrl-C (by "
        "default it stops once the evaluation ends)",
    )
    add_log_arg(
        p,
        what="each committed round (accepted, participation, duration, reported loss) and the "
        "evaluations (each round's model, the final one)",
        folder="OUT",
        where="--out",
    )
    add_progress_arg(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_setting_args(
        p,
        defaults=CLUSTER_DEFAULTS,
        own={"round_eval_sweeps": int},
        own_doc="round_eval_sweeps: sweeps M of the per-round CE, default 2; docs/protocol.md",
    )
    p.set_defaults(handler=run)


ROUND_EVAL_SWEEPS = 2
"""Sweeps M of the per-round CE (on --eval-bytes): cluster's own `--set round_eval_sweeps=M`."""

CLUSTER_DEFAULTS = {
    "deadline_s": 60.0,
    "min_round_s": 0.0,
    "live_eval_every": 1,
}
"""Settings that differ here from a public aggregator's: short rounds and no minimum round
length, since every worker of a cluster is the user's own, and a minimum round only holds back
workers that are done. The defences are the public aggregator's: with the paired test at a
quarter step, the effect probe accepted every honest update of a 40-round run at the small
shape, and the final CE was the undefended run's within 0.002 (bench/adversarial.py --preset
small); it costs one forward pass of the block per update and one backward pass per version
(docs/protocol.md, Effect probe, Cost). `--effect-probe off` saves that.
The live evaluation is on, every round: a cluster always has the data, and its user watches
the dashboard for the validation CE while the rounds run (a public aggregator's CPU serves the
workers first: there it is off unless asked for). `--set live_eval_every=0` turns it off."""


def _check_args(args: argparse.Namespace) -> None:
    for name in (
        "workers",
        "rounds",
        "threads",
        "eval_bytes",
        "final_bytes",
        "final_sweeps",
    ):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if args.timeout <= 0:
        raise ConfigError("--timeout must be positive")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: every process is stopped on the way out


def _write_summary(out: Path, summary: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())


def _viewer_token(state: Any, out: Path) -> tuple[str, Path]:
    """A token that may only watch (the status, the dashboard), saved in OUT/viewer.token (mode
    600): the run's other tokens are stored only as hashes, so this is the one to look with."""
    token = new_token()
    state.ledger.add_token("viewer", hash_token(token), time.time(), viewer=True)
    path = out / "viewer.token"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    devices = spread_devices(args.workers, args.device, args.gpus)  # before any side effect
    eval_device = devices[0] if args.gpus is None else "cuda:0"
    backends = log_backends(args)  # an unknown backend or a missing library: before any write
    unit = unit_of(args)
    overrides = {**CLUSTER_DEFAULTS, **settings_overrides(args)}
    args.eval_sweeps = overrides.pop("round_eval_sweeps", ROUND_EVAL_SWEEPS)  # cluster_eval's
    if args.eval_sweeps <= 0:
        raise ConfigError(f"--set round_eval_sweeps={args.eval_sweeps} must be positive")
    # the probe judges blocks: off for DiLoCo, and refused if asked for
    if unit == "reference" and overrides.setdefault("effect_probe", "off") != "off":
        raise ConfigError(
            "a reference (DiLoCo) cluster takes --effect-probe off: the probe judges blocks"
        )
    local_steps = overrides.get("local_steps", 10)
    cfg = resolve_rounds_config(args, local_steps)
    if unit == "reference":
        cfg = reference_config(cfg)
    elif args.workers < cfg.model.blocks:  # a worker trains one block: the rest would wait
        raise ConfigError(
            f"--workers {args.workers} for {cfg.model.blocks} blocks: each worker trains one "
            f"block, so block(s) {list(range(args.workers, cfg.model.blocks))} would get none "
            f"and the run would never end; use --workers {cfg.model.blocks} or more"
        )
    out = Path(args.out)
    replacing = (out / "state").exists() or (out / "summary.json").exists()
    if replacing and not args.overwrite:
        raise ConfigError(
            f"{out} already holds a cluster run; pass --overwrite or choose another --out"
        )
    data_path = str(resolve_data_path(args.data))
    patterns = file_patterns(args)
    valid = load_split(data_path, "valid", patterns)
    record = corpus_record(data_path, patterns=patterns)  # the model's data.json, as train's
    if replacing:  # only now: a bad flag or missing data above leaves the old run whole
        for name in ("state", "logs", "model"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / "summary.json").unlink(missing_ok=True)
        (out / "viewer.token").unlink(missing_ok=True)
        remove_outputs(out)  # the old run's logs, which TensorBoard would show as this one's
    overrides.update(
        {
            "max_rounds": args.rounds,
            "keep_versions": 0,
            "n_workers": args.workers,
            "local_steps": local_steps,
        }
    )
    state = create_state(out / "state", cfg, overrides, initial_units(cfg, unit), unit)
    tokens = []
    for i in range(args.workers):
        tokens.append(new_token())
        state.ledger.add_token(f"worker-{i}", hash_token(tokens[-1]), time.time())
    viewer, viewer_file = _viewer_token(state, out)

    bar = progress_bar(
        args,
        total=args.rounds * cfg.model.blocks,
        unit="round",
        desc=f"cluster {args.workers} workers",
    )

    config = {
        **cfg.to_dict(),
        "cluster": {"workers": args.workers, "rounds": args.rounds, "local_steps": local_steps},
    }
    tracking = Tracking(backends, out, config)
    logged: dict[str, int] = {}

    def log_rounds(status: dict[str, Any]) -> None:
        for record in round_records(status, logged, state.ledger.round_losses):
            tracking.log(record)

    def progress(status: dict[str, Any]) -> None:
        log_rounds(status)
        bar.n = sum(min(r, args.rounds) for r in status["rounds"])
        bar.set_postfix(
            versions=",".join(map(str, status["versions"])),
            live=status["workers"]["live"],
            refresh=False,
        )
        bar.refresh()

    cluster = LocalCluster(
        state,
        tokens,
        viewer,  # the cluster only watches its aggregator too
        out / "logs",
        data=data_path,
        data_patterns=patterns.argv(),
        threads=args.threads,
        timeout_s=args.timeout,
        devices=devices,
    )
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        url = cluster.start()
        on = sorted(set(devices), key=devices.index)
        say(f"{args.workers} workers on {url} (on {', '.join(on)}; logs in {out / 'logs'})")
        say(f"dashboard {url}/dashboard#token={viewer}")
        say(
            f"viewer token {viewer} (in {viewer_file}; it may only watch: blocktrain status "
            f"{url} --token-file {viewer_file})"
        )
        status = cluster.wait_rounds(on_status=progress)
        log_rounds(status)  # it lists every round
        bar.close()
        wall_seconds = cluster.rounds_seconds or 0.0
        say(f"rounds done in {wall_seconds:.0f}s; every worker has left")
        summary, line = evaluate_cluster(
            args, cfg, unit, state, valid, local_steps, out, status, device=eval_device
        )
        write_record(out / "model", record)  # what eval, generate and export compare with
        summary["data"] = record
        summary["wall_seconds"] = wall_seconds
        summary["workers_report"] = cluster.worker_reports()
        summary["exit_codes"] = cluster.exit_codes()  # the aggregator's: None, it still serves
        for record in evaluation_records(summary):
            tracking.log(record)
        tracking.close()  # written out now, before --keep-dashboard waits
        if args.keep_dashboard:
            _write_summary(out, summary)
            _report(args, summary, line, wall_seconds)
            say(f"the dashboard stays up at {url}/dashboard until Ctrl-C (--keep-dashboard)")
            try:
                while cluster.aggregator is not None and cluster.aggregator.popen.poll() is None:
                    time.sleep(0.5)
                say("the aggregator exited by itself")
            except KeyboardInterrupt:
                say("stopping the aggregator")
    finally:
        bar.close()
        tracking.close()
        cluster.close()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        state.close()
    summary["exit_codes"] = cluster.exit_codes()
    _write_summary(out, summary)
    if not args.keep_dashboard:
        _report(args, summary, line, wall_seconds)
    return 0


def _report(args: argparse.Namespace, summary: dict[str, Any], line: str, wall: float) -> None:
    if args.json:
        print_json(summary)
    else:
        print(f"cluster of {args.workers} workers: {args.rounds} rounds in {wall:.0f}s; {line}")
        sys.stdout.flush()
