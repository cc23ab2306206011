"""`blocktrain report`: plots and an HTML page of a training run, from an aggregator's state
folder (read while it runs, or after), a `blocktrain simulate` output folder, a `blocktrain
cluster` output folder (its state/ and each round's validation CE from summary.json) or a
`blocktrain train` run folder (its metrics.jsonl: each block's loss components and the
validation CE by step). Training losses and the validation CE are plotted apart, each labelled
for what it is, against one integer x axis: rounds closed (round r as the status numbers it,
from 0, at r + 1), or a train run's steps."""

from __future__ import annotations

import argparse
from pathlib import Path

from blocktrain.cli.common import Formatter
from blocktrain.errors import ConfigError
from blocktrain.protocol.ops.report import write_report
from blocktrain.protocol.store.history import load

EXAMPLES = """examples:
  blocktrain report state/ --out report/          # an aggregator's state folder
  blocktrain report runs/c3 --out report/         # a cluster output folder (state/, summary.json)
  blocktrain report runs/small --out report/      # a train run folder (metrics.jsonl)
  blocktrain report runs/sim --regime wan --out report/   # a simulate output folder
  python -m http.server -d report/                # then open http://127.0.0.1:8000/
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="plot a training run (loss, participation, refusals) as PNGs and an HTML page",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument(
        "source",
        metavar="RUN_OR_STATE",
        type=Path,
        help="a state, simulate, cluster output or train run folder",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the PNGs and index.html")
    p.add_argument("--regime", help="which regime of a simulate folder (default: the first)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not args.source.is_dir():
        raise ConfigError(f"{args.source} is not a folder")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a folder")
    hist = load(args.source, args.regime)  # a ConfigError, before anything is written
    written = write_report(hist, args.out)
    for path in written:
        print(path)
    return 0
