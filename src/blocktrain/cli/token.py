"""`blocktrain token`: create, list and revoke the bearer tokens of an aggregator's state.

Tokens are shown once, when created, and stored only as SHA-256 hashes in the state's ledger.
A running aggregator sees additions and revocations at once.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

from blocktrain.cli.common import Formatter, print_json
from blocktrain.errors import ConfigError
from blocktrain.protocol.storage import StateDir
from blocktrain.protocol.tokens import hash_token, new_token

EXAMPLES = """examples:
  blocktrain token add --state runs/agg --name alice      # prints the new token alone
  blocktrain token list --state runs/agg
  blocktrain token revoke --state runs/agg --name alice
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "token",
        help="manage the aggregator's worker tokens",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    tsub = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    a = tsub.add_parser(
        "add", help="create a token and print it", epilog=EXAMPLES, formatter_class=Formatter
    )
    a.add_argument("--state", required=True, metavar="DIR", help="the aggregator's state folder")
    a.add_argument("--name", required=True, help="a unique name for the token's holder")
    a.set_defaults(handler=run_add)
    ls = tsub.add_parser(
        "list", help="list tokens (never their values)", epilog=EXAMPLES, formatter_class=Formatter
    )
    ls.add_argument("--state", required=True, metavar="DIR")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(handler=run_list)
    r = tsub.add_parser(
        "revoke", help="revoke a token by name", epilog=EXAMPLES, formatter_class=Formatter
    )
    r.add_argument("--state", required=True, metavar="DIR")
    r.add_argument("--name", required=True)
    r.set_defaults(handler=run_revoke)


def _state(path: str, *, create: bool) -> StateDir:
    root = Path(path)
    if not create and not (root.is_dir() and (root / "ledger.sqlite").is_file()):
        raise ConfigError(
            f"{path} holds no aggregator ledger; create a token with "
            "`blocktrain token add` or start the aggregator first"
        )
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{path} is not a folder")
    return StateDir(root)


def run_add(args: argparse.Namespace) -> int:
    name = args.name.strip()
    if not name or len(name) > 100:
        raise ConfigError("--name must hold 1 to 100 characters")
    state = _state(args.state, create=True)
    try:
        if state.ledger.token_by_name(name) is not None:
            raise ConfigError(
                f"a token named {name!r} already exists in {args.state}; "
                "choose another --name (or revoke that one)"
            )
        token = new_token()
        state.ledger.add_token(name, hash_token(token), time.time())
    finally:
        state.close()
    print(token)
    return 0


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def run_list(args: argparse.Namespace) -> int:
    state = _state(args.state, create=False)
    try:
        rows = state.ledger.tokens()
    finally:
        state.close()
    if args.json:
        print_json(
            [{"id": r.id, "name": r.name, "created": r.created, "revoked": r.revoked} for r in rows]
        )
        return 0
    print(f"{'name':24s} {'created':22s} revoked")
    for r in rows:
        print(f"{r.name:24s} {_when(r.created):22s} {_when(r.revoked)}")
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    state = _state(args.state, create=False)
    try:
        row = state.ledger.token_by_name(args.name)
        if row is None:
            raise ConfigError(f"no token named {args.name!r} in {args.state}")
        if not state.ledger.revoke_token(args.name, time.time()):
            raise ConfigError(f"token {args.name!r} is already revoked")
    finally:
        state.close()
    print(f"revoked {args.name}")
    return 0
