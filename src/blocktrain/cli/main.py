"""Entry point of the `blocktrain` command: registers the subcommands and turns every error a
user can fix into one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from blocktrain import __version__
from blocktrain.cli import (
    aggregator,
    ban,
    cluster,
    data,
    distill,
    doctor,
    evaluate,
    export,
    generate,
    join,
    plan,
    report,
    rollback,
    serve,
    serve_block,
    simulate,
    status,
    tls,
    token,
    train,
    worker,
)
from blocktrain.errors import BlockTrainError
from blocktrain.runtime import keep_freed_memory, serve_from_heap

SUBCOMMANDS = (
    train,
    distill,
    evaluate,
    generate,
    plan,
    data,
    serve_block,
    serve,
    aggregator,
    worker,
    join,
    doctor,
    token,
    tls,
    ban,
    rollback,
    status,
    export,
    report,
    cluster,
    simulate,
)

EPILOG = """examples:
  blocktrain train --preset tiny --out runs/tiny
  blocktrain eval runs/tiny --split test --json
  blocktrain generate runs/tiny --prompt "The " --bytes 200
  blocktrain plan --preset paper --json
  blocktrain simulate --workers 6 --rounds 30 --regime lockstep,mild,wan --out runs/sim
"""


class UserLines(logging.Formatter):
    """A log record as the command's own warning lines read, `blocktrain: warning: ...` (it
    was `WARNING blocktrain.data.corpus: ...`); -v shows the level and the logger's name."""

    def __init__(self) -> None:
        super().__init__("blocktrain: %(level)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.level = record.levelname.lower()
        return super().format(record)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blocktrain",
        description="Train a byte-level language model as independently trainable diffusion "
        "blocks, evaluate it and generate from it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"blocktrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(name)s: %(message)s") if args.verbose else UserLines()
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, handlers=[handler]
    )
    # servers allocate from one heap trimmed every few seconds; a trainer keeps its activations' pages
    (serve_from_heap if getattr(args, "server", False) else keep_freed_memory)()
    try:
        return int(args.handler(args) or 0)
    except BlockTrainError as exc:
        print(f"blocktrain: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("blocktrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
