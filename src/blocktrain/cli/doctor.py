"""`blocktrain doctor`: why this machine cannot train for an aggregator. One line per check:
URL, DNS, TCP, TLS, HTTP, version, token and clock (`protocol.worker.doctor`); exit code 0 when
every check passed, 1 when one failed."""

from __future__ import annotations

import argparse

from blocktrain.cli.common import Formatter, add_ca_arg, add_token_args, checked_ca, resolve_token
from blocktrain.errors import ConfigError
from blocktrain.protocol.worker.doctor import Check, diagnose

EXAMPLES = """examples:
  blocktrain doctor http://10.0.0.5:8470 --token-file ~/.blocktrain-token
  blocktrain doctor https://agg.example:8470 --ca-file tls/cert.pem   # without a token: no token check
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check the way to an aggregator: DNS, TCP, TLS, version, token, clock",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("url", metavar="URL", help="the aggregator's URL")
    add_token_args(p)
    add_ca_arg(p)
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="per network step")
    p.set_defaults(handler=run)


def checks_for(args: argparse.Namespace) -> list[Check]:
    if args.timeout <= 0:
        raise ConfigError("--timeout must be positive")
    try:
        token: str | None = resolve_token(args)
    except ConfigError:
        if args.token_file or args.token:
            raise  # a token was given but cannot be read: say so
        token = None  # none anywhere: the token check is skipped
    return diagnose(args.url, token, verify=checked_ca(args), timeout_s=args.timeout)


def run(args: argparse.Namespace) -> int:
    checks = checks_for(args)
    for check in checks:
        print(check.line())
    return 1 if any(c.ok is False for c in checks) else 0
