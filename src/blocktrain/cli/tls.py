"""`blocktrain tls self-signed`: a certificate and key for serving HTTPS on a private network,
in one command (with `openssl`). The aggregator serves them with --tls-cert/--tls-key; workers
and `status` trust the certificate with --ca-file. For a public name, prefer a certificate from
a CA (e.g. Let's Encrypt): pass its files the same way, and clients need no --ca-file."""

from __future__ import annotations

import argparse
from pathlib import Path

from blocktrain.cli.common import Formatter
from blocktrain.tls import self_signed

EXAMPLES = """examples:
  blocktrain tls self-signed --out tls --host agg.example --host 10.0.0.5
  blocktrain aggregator --state runs/agg --host 0.0.0.0 --tls-cert tls/cert.pem \\
      --tls-key tls/key.pem
  blocktrain worker --aggregator https://agg.example:8470 --ca-file tls/cert.pem \\
      --token-file token.txt
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tls",
        help="make a self-signed TLS certificate for the aggregator",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    tls_sub = p.add_subparsers(dest="tls_command", metavar="ACTION", required=True)
    s = tls_sub.add_parser(
        "self-signed",
        help="write DIR/cert.pem and DIR/key.pem",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    s.add_argument("--out", required=True, metavar="DIR", help="folder for cert.pem and key.pem")
    s.add_argument(
        "--host",
        action="append",
        metavar="NAME",
        help="a DNS name or IP address clients use (repeat; default: localhost and 127.0.0.1)",
    )
    s.add_argument("--days", type=int, default=365, help="validity in days")
    s.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    files = self_signed(Path(args.out), args.host or ["localhost", "127.0.0.1"], args.days)
    print(f"wrote {files.cert} and {files.key} (key mode 600)")
    return 0
