"""`blocktrain ban`: shut a token out for good.

Banning revokes the token (if it was not yet), marks it banned with an optional reason, and so
refuses its every request with reason `banned_token` (403). A running aggregator notices within
a tick: it drops the token's accepted but uncommitted updates from their open rounds and
retires its workers; a stopped one does so when it starts. `blocktrain token revoke` does the
same without the ban mark.
"""

from __future__ import annotations

import argparse
import time

from blocktrain.cli.common import Formatter
from blocktrain.cli.token import open_ledger_state
from blocktrain.errors import ConfigError

EXAMPLES = """examples:
  blocktrain ban runs/agg mallory
  blocktrain ban runs/agg mallory --reason "sign-flipped updates in rounds 40-42"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ban",
        help="revoke a token for good and drop its pending updates",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("state", metavar="STATE", help="the aggregator's state folder")
    p.add_argument("name", metavar="TOKEN_NAME", help="the token's name (`token list`)")
    p.add_argument("--reason", help="why, recorded in the ledger and told to the token's holder")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    state = open_ledger_state(args.state)
    try:
        row = state.ledger.token_by_name(args.name)
        if row is None:
            raise ConfigError(f"no token named {args.name!r} in {args.state}")
        reason = (args.reason or "").strip()[:200] or None
        if not state.ledger.ban_token(args.name, time.time(), reason):
            raise ConfigError(f"token {args.name!r} is already banned")
    finally:
        state.close()
    print(f"banned {args.name}")
    return 0
