"""`blocktrain export`: assemble an aggregator's latest committed blocks into a run folder that
`blocktrain eval` and `blocktrain generate` read."""

from __future__ import annotations

import argparse
from pathlib import Path

from blocktrain.cli.common import Formatter
from blocktrain.protocol.store.state import read_committed
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.local import write_assembled, write_reference

EXAMPLES = """examples:
  blocktrain export --state runs/agg --out runs/agg-model
  blocktrain eval runs/agg-model --split test
  blocktrain generate runs/agg-model --prompt "The " --bytes 200
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="assemble the aggregator's blocks into a run folder",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("--state", required=True, metavar="DIR", help="the aggregator's state folder")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="the run folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    ckpt.check_run_dir_free(Path(args.out), overwrite=args.overwrite)
    info = read_committed(Path(args.state))
    if info.unit == "reference":  # a DiLoCo run: its one unit is the end-to-end model
        write_reference(Path(args.out), info.cfg, info.blocks[0], info.step)
    else:
        write_assembled(Path(args.out), info.cfg, info.blocks, info.step)
    shown = ", ".join(f"b{b}=v{v}" for b, v in info.versions.items())
    print(
        f"exported {args.state} to {args.out} (versions {shown}; {info.step} local steps per "
        "replica)"
    )
    return 0
