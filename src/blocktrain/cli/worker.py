"""`blocktrain worker`: train one block replica for an aggregator.

Registers with the aggregator (which assigns the block with the fewest live replicas, or
--block; with one aggregator per block, the worker follows GET /v1/directory to the aggregator
of its --block), then loops: wait for a new round, pull the block's weights, train H local steps on
this machine's data (the AdamW state stays here, across rounds), push the delta. Retries with
backoff when the aggregator is away, re-syncs after a refusal, and leaves cleanly on SIGTERM
or Ctrl-C.

With --state DIR it keeps, after each pushed round, its registration (the aggregator, worker id,
block, data seed), its AdamW state and the delta codec's error-feedback residual in DIR; started
again with the same DIR it rejoins as the same worker (the aggregator takes a worker back from
its own token only) and carries on where it stopped, so its next update is the one it would have
sent had it never stopped. A DIR of another run or block is refused (--fresh: a new worker).

It prints a line per round on stderr (the round, its local steps, the bytes trained per second,
the loss, the verdict: accepted, or refused with its reason; a hint when updates come late), and
its report at the end on stdout:

  worker 0 on block 1 (data seed 1, H = 10 local steps a round)
  round 0 (block 1): 10 steps in 2.1s, 1,950 bytes/s, loss 5.412; accepted
  round 1 (block 1): 10 steps in 71.3s, 57 bytes/s, loss 4.871; refused: late (...)
    hint: updates arrive after the round's deadline (...): raise the aggregator's --deadline or
    lower its --local-steps, or run it with --set pacing=adaptive

With --log-to the same rounds go to TensorBoard, W&B or MLflow too, at step = the round:
worker/loss, worker/steps, worker/seconds, worker/bytes_per_s, worker/accepted (1 or 0),
worker/late, worker/refused/REASON (1), in the --state folder.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from blocktrain.cli.common import (
    Formatter,
    add_ca_arg,
    add_data_arg,
    add_log_arg,
    add_threads_arg,
    add_token_args,
    checked_ca,
    file_patterns,
    log_backends,
    print_json,
    resolve_token,
    use_threads,
)
from blocktrain.config import RunConfig
from blocktrain.data import ByteSource, load_split
from blocktrain.device import DEVICE_HELP, resolve_device
from blocktrain.errors import ConfigError
from blocktrain.protocol.store.state import run_unit
from blocktrain.protocol.worker.client import AggregatorClient, Registration
from blocktrain.protocol.worker.loop import LATE_HINT, WorkerLoop
from blocktrain.protocol.worker.resume import WorkerFolder
from blocktrain.protocol.worker.retrying import RetryPolicy
from blocktrain.serving.shared.transport import check_url
from blocktrain.training.local import LocalBlockTrainer, local_trainer
from blocktrain.training.tracking import OUTPUTS, Tracking

EXAMPLES = """examples:
  blocktrain worker --aggregator http://10.0.0.5:8470 --token-file ~/.blocktrain-token
  BLOCKTRAIN_TOKEN=bt_... blocktrain worker --aggregator https://agg.example:8470 --block 1
  blocktrain worker --aggregator https://agg.example:8470 --ca-file tls/cert.pem \\
      --token-file token.txt --data my-corpus/
  # one aggregator per block: any of them; the worker follows its directory to block 2's
  blocktrain worker --aggregator http://10.0.0.5:8470 --token-file token.txt --block 2
  # kill it and start it again: the same worker, its optimizer state and round resumed
  blocktrain worker --aggregator http://10.0.0.5:8470 --token-file token.txt --state worker-a/
  # each round's line to TensorBoard too, in worker-a/tensorboard/
  blocktrain worker --aggregator http://10.0.0.5:8470 --token-file token.txt --state worker-a/ \\
      --log-to tensorboard
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="train one block replica for an aggregator",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("--aggregator", required=True, metavar="URL", help="the aggregator's URL")
    add_worker_args(p)
    p.set_defaults(handler=run)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Every flag of a worker but the aggregator's URL (`blocktrain join` takes them too)."""
    add_token_args(p)
    p.add_argument("--block", type=int, metavar="B", help="ask for this block")
    add_data_arg(p)
    p.add_argument(
        "--name",
        help="a label shown in the aggregator's status "
        "(`blocktrain status`, /v1/status, the dashboard)",
    )
    p.add_argument("--device", default="auto", metavar="DEVICE", help=DEVICE_HELP)
    p.add_argument(
        "--state",
        metavar="DIR",
        help="the worker's own folder: its registration, optimizer state and round, saved after "
        "each push; a worker started again with it rejoins as the same worker (one folder per "
        "worker; made when missing)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="with --state: discard the worker DIR holds and start a new one there",
    )
    add_threads_arg(p)
    add_ca_arg(p)
    p.add_argument("--max-rounds", type=int, help="stop after this many rounds")
    add_log_arg(
        p,
        what="each round's line (its steps, seconds, bytes/s, loss and verdict, at step = "
        "the round)",
        folder="STATE",
        where="the --state folder (which --log-to needs)",
    )
    p.add_argument("--json", action="store_true", help="print the final report as JSON")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no line per round on stderr (the report at the end still prints)",
    )


def say(line: str) -> None:
    """A worker's progress line, on stderr (a log file when `cluster` starts it)."""
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    check_url(args.aggregator, "--aggregator")  # a typo is one line, not a traceback
    if args.block is not None and args.block < 0:
        raise ConfigError("--block must be >= 0")
    if args.max_rounds is not None and args.max_rounds <= 0:
        raise ConfigError("--max-rounds must be positive")
    if args.fresh and not args.state:
        raise ConfigError("--fresh discards the worker of a --state folder: give --state DIR")
    backends = log_backends(args)
    if backends and not args.state:
        raise ConfigError("--log-to writes in the worker's folder: give --state DIR")
    device = resolve_device(args.device)  # before the aggregator hears of this worker
    token = resolve_token(args)
    verify = checked_ca(args)
    use_threads(args)
    # checked (and locked) before the aggregator hears of this worker
    folder = (
        WorkerFolder(args.state, args.aggregator, block=args.block, fresh=args.fresh, extra=OUTPUTS)
        if args.state
        else None
    )
    resumed = folder.round if folder is not None and folder.round >= 0 else None
    config = {"aggregator": args.aggregator, "name": args.name, "block": args.block}
    tracking = Tracking(backends, Path(args.state or "."), config, resumed_at=resumed)
    try:
        train = load_split(args.data, "train", file_patterns(args))
        return _work(args, token, verify, device, train, folder, tracking)
    finally:
        tracking.close()
        if folder is not None:
            folder.close()


def _work(
    args: argparse.Namespace,
    token: str,
    verify: str | bool,
    device: torch.device,
    train: ByteSource,
    folder: WorkerFolder | None,
    tracking: Tracking,
) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    # route = relay: the streams of a round, out and in, a step at a time on disk
    spool = Path(tempfile.mkdtemp(prefix="blocktrain-relay-"))

    def make_trainer(reg: Registration, config: dict[str, Any]) -> LocalBlockTrainer:
        cfg = RunConfig.from_dict(config["run_config"])
        unit = run_unit(config["run_config"])
        return local_trainer(
            cfg, unit, reg.block, train, data_seed=reg.data_seed, device=device, spool=spool
        )

    client = AggregatorClient(
        args.aggregator,
        token,
        verify=verify,
        retry=RetryPolicy(),  # gives up after 5 minutes without an answer
        stop=stop,
    )
    try:
        loop = WorkerLoop(
            client,
            make_trainer,
            block=args.block,
            name=args.name,
            stop=stop,
            max_rounds=args.max_rounds,
            say=(lambda line: None) if args.quiet else say,
            folder=folder,
            on_round=lambda outcome: tracking.log(outcome.record()),
            spool=spool,
        )
        report = loop.run()
    finally:
        client.close()
        shutil.rmtree(spool, ignore_errors=True)
    if args.json:
        print_json(report.to_dict())
    else:
        print(
            f"worker {report.worker_id} (block {report.block}): {report.rounds} rounds, "
            f"{report.accepted} accepted, refused {report.refused or 'none'}; stopped by "
            f"{report.stopped_by or 'end'}"
        )
    if report.late and not args.quiet:
        say(f"{report.late} of {report.rounds} updates came late: {LATE_HINT}")
    return 0
