"""`blocktrain rollback`: make a kept version of a block its weights again, as a new version.

The kept version V is written as version current + 1 (versions never go back) and recorded in
the ledger's `rollbacks` table; the open round's accepted updates, trained on the weights being
undone, are dropped. Stop the aggregator first: the command refuses while it runs, and the
aggregator resumes from the rolled-back version when it starts. The aggregator's
`--set keep_versions=N` sets how many versions it keeps (version 0 is always kept).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from blocktrain.cli.common import Formatter, print_json
from blocktrain.protocol.store.recovery import rollback
from blocktrain.protocol.store.storage import StateDir

EXAMPLES = """examples:
  blocktrain rollback runs/agg --block 0 --to-version 12
  blocktrain rollback runs/agg --block 1 --to-version 0 --json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollback",
        help="make a kept version of a block its weights again (aggregator stopped)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("state", metavar="STATE", help="the aggregator's state folder")
    p.add_argument("--block", type=int, required=True, metavar="B", help="the block to roll back")
    p.add_argument(
        "--to-version", type=int, required=True, metavar="V", help="a kept, earlier version"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    state = StateDir(Path(args.state))
    try:
        done = rollback(state, block=args.block, to_version=args.to_version, now=time.time())
    finally:
        state.close()
    if args.json:
        print_json(done)
    else:
        print(
            f"block {done['block']}: version {done['to_version']} is now version "
            f"{done['new_version']} (was {done['from_version']}); round {done['round']} closed, "
            f"{done['dropped_updates']} pending update(s) dropped"
        )
    return 0
