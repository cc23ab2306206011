"""`blocktrain token`: create, list and revoke the bearer tokens of an aggregator's state.

Tokens are shown once, when created, and stored only as SHA-256 hashes in the state's ledger.
A token pinned to blocks (`--block`, repeatable) registers only on those. A viewer token
(`--viewer`) may only watch: the status (`blocktrain status`), the dashboard, /metrics, the
config, the directory and the open round; every other call answers 403 `viewer_token`. A running aggregator
sees additions and revocations at once: a revoked token's accepted but uncommitted updates are
dropped from their open rounds within a tick, and its workers retired (`blocktrain ban` does
the same and refuses the token for good).
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

from blocktrain.cli.common import Formatter, print_json
from blocktrain.errors import ConfigError
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token

EXAMPLES = """examples:
  blocktrain token add --state runs/agg --name alice      # prints the new token alone
  blocktrain token add bob --state runs/agg --block 2 --block 3   # bob trains blocks 2, 3 only
  blocktrain token add carol --state runs/agg0 --state runs/agg1   # one token, two aggregators
  blocktrain token add dashboard --state runs/agg --viewer   # may watch the run, never train
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
    a.add_argument(
        "--state",
        required=True,
        action="append",
        metavar="DIR",
        help="the aggregator's state folder; repeat it to add one token to several (one "
        "aggregator per block: the worker's token must be known to each)",
    )
    a.add_argument("positional_name", nargs="?", metavar="NAME", help="the same as --name")
    a.add_argument("--name", help="a unique name for the token's holder")
    a.add_argument(
        "--block",
        type=int,
        action="append",
        default=[],
        metavar="B",
        help="pin the token to block B (repeatable); unpinned tokens may train any block",
    )
    a.add_argument(
        "--viewer",
        action="store_true",
        help="a token that may only watch (the status, the dashboard, metrics), never train",
    )
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


def open_ledger_state(path: str, *, create: bool = False) -> StateDir:
    """The state folder at `path`, which must hold a ledger unless `create`."""
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
    if args.positional_name is not None and args.name is not None:
        raise ConfigError("give the name once: NAME or --name")
    name = (args.name if args.name is not None else args.positional_name or "").strip()
    if not name or len(name) > 100:
        raise ConfigError("NAME (or --name) must hold 1 to 100 characters")
    if args.viewer and args.block:
        raise ConfigError("a --viewer token trains no block: give --viewer or --block, not both")
    states = [open_ledger_state(path, create=True) for path in args.state]
    try:
        for path, state in zip(args.state, states, strict=True):  # every check before a write
            n_blocks = state.n_blocks() if state.initialised else None
            for b in args.block:
                if b < 0 or (n_blocks is not None and b >= n_blocks):
                    limit = "" if n_blocks is None else f" 0..{n_blocks - 1}"
                    raise ConfigError(f"--block {b} is not a block of{limit or ' the run'}")
            if state.ledger.token_by_name(name) is not None:
                raise ConfigError(
                    f"a token named {name!r} already exists in {path}; "
                    "choose another --name (or revoke that one)"
                )
        token = new_token()
        for state in states:
            state.ledger.add_token(
                name, hash_token(token), time.time(), blocks=args.block, viewer=args.viewer
            )
    finally:
        for state in states:
            state.close()
    print(token)
    return 0


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def run_list(args: argparse.Namespace) -> int:
    state = open_ledger_state(args.state)
    try:
        rows = state.ledger.tokens()
    finally:
        state.close()
    if args.json:
        print_json(
            [
                {
                    "id": r.id,
                    "name": r.name,
                    "created": r.created,
                    "revoked": r.revoked,
                    "banned": r.banned,
                    "ban_reason": r.ban_reason,
                    "blocks": list(r.blocks),
                    "viewer": r.viewer,
                }
                for r in rows
            ]
        )
        return 0
    print(f"{'name':24s} {'created':22s} {'revoked':22s} {'banned':22s} blocks")
    for r in rows:
        pins = "none (viewer)" if r.viewer else ",".join(map(str, r.blocks)) or "any"
        print(
            f"{r.name:24s} {_when(r.created):22s} {_when(r.revoked):22s} "
            f"{_when(r.banned):22s} {pins}"
        )
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    state = open_ledger_state(args.state)
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
