"""`blocktrain data`: fetch WikiText, or describe a corpus."""

from __future__ import annotations

import argparse
from pathlib import Path

from blocktrain.cli.common import Formatter, add_progress_arg, print_json, progress_bar
from blocktrain.data import ByteCorpus, fetch_wikitext, resolve_data_path

EXAMPLES = """examples:
  blocktrain data fetch wikitext-2 --to data/wikitext-2     # needs internet
  blocktrain data info data/wikitext-2
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="fetch or inspect training text",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    f = dsub.add_parser(
        "fetch",
        help="download and unpack an official WikiText archive",
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    f.add_argument("name", choices=("wikitext-2", "wikitext-103"))
    f.add_argument("--to", required=True, metavar="DIR", help="folder for the wiki.*.raw files")
    f.add_argument("--url", help="archive URL (default: the official one)")
    f.add_argument("--sha256", help="expected archive checksum")
    add_progress_arg(f)
    f.set_defaults(handler=run_fetch)
    i = dsub.add_parser(
        "info", help="describe a corpus and its splits", epilog=EXAMPLES, formatter_class=Formatter
    )
    i.add_argument("path", nargs="?", help="corpus path (default: $BLOCKTRAIN_DATA)")
    i.set_defaults(handler=run_info)


def run_fetch(args: argparse.Namespace) -> int:
    bar = progress_bar(args, unit="B", unit_scale=True, desc=f"fetch {args.name}")

    def progress(done: int, total: int | None) -> None:
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        dest = fetch_wikitext(
            args.name, Path(args.to), url=args.url, sha256=args.sha256, progress=progress
        )
    finally:
        bar.close()
    print(dest)
    return 0


def run_info(args: argparse.Namespace) -> int:
    corpus = ByteCorpus.open(resolve_data_path(args.path))
    print_json(corpus.describe())
    return 0
