"""`blocktrain join`: join a run in one command. Checks the way to the aggregator (as
`blocktrain doctor` does: DNS, TCP, TLS, version, token, clock), stops with what failed, else
runs a worker on the block the aggregator chooses (the one with the fewest live replicas that
this token may train; `--block` asks for one)."""

from __future__ import annotations

import argparse

from blocktrain.cli import doctor, worker
from blocktrain.cli.common import Formatter, log_backends
from blocktrain.device import resolve_device

EXAMPLES = """examples:
  blocktrain join http://10.0.0.5:8470 --token-file ~/.blocktrain-token
  blocktrain join https://agg.example:8470 --token-file token.txt --ca-file tls/cert.pem \\
      --data my-corpus/ --device cuda
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "join",
        help="check the way to an aggregator, then train for it",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("url", metavar="URL", help="the aggregator's URL")
    worker.add_worker_args(p)
    p.set_defaults(handler=run, timeout=doctor.CHECK_TIMEOUT_S)


def run(args: argparse.Namespace) -> int:
    resolve_device(args.device)  # one line, before the aggregator is contacted
    log_backends(args)  # --log-to: an unknown backend or a missing library, before the checks
    checks = doctor.checks_for(args)
    failed = [c for c in checks if c.ok is False]
    for check in checks:
        print(check.line(), flush=True)
    if failed:
        print(f"not joining: {failed[0].name} failed (see above)", flush=True)
        return 1
    args.aggregator = args.url
    return worker.run(args)
