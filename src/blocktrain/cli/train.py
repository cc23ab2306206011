"""`blocktrain train`: train every block in turn, one chosen block, or the reference."""

from __future__ import annotations

import argparse
from pathlib import Path

from blocktrain.cli.common import (
    Formatter,
    add_config_args,
    add_data_arg,
    add_device_arg,
    add_log_arg,
    add_progress_arg,
    file_patterns,
    log_backends,
    print_json,
    resolve_config,
)
from blocktrain.config import parse_blocks
from blocktrain.data import ByteSource, FilePatterns, load_split
from blocktrain.data.provenance import check_data, corpus_record, read_record, write_record
from blocktrain.device import resolve_device
from blocktrain.errors import ConfigError, DataError
from blocktrain.training import Trainer, read_config
from blocktrain.training.tracking import close_trackers, open_trackers

EXAMPLES = """examples:
  blocktrain train --preset tiny --out runs/tiny            # all blocks, about 2 minutes on CPU
  blocktrain train --preset small --set span=4 lr=1e-3      # override config fields
  blocktrain train --preset tiny --block 0 --out runs/b0    # one block, as a worker would
  blocktrain train --preset tiny --block 1 --upstream runs/b0 --out runs/b1  # reads block 0 frozen
  blocktrain train --preset tiny --set route=state --out runs/state  # only z between blocks
  blocktrain train --preset tiny --set route=state --block 1 --out runs/s1  # needs no upstream
  blocktrain train --preset tiny --reference --out runs/ref # the end-to-end reference
  blocktrain train --resume --out runs/tiny --steps 600     # continue a run (to 600 steps)
  blocktrain train --preset paper --device cuda:0 --out runs/paper  # on the first GPU
  blocktrain train --preset tiny --out runs/tiny --log-to tensorboard  # + RUN_DIR/tensorboard/
  blocktrain train --preset tiny --out runs/tiny --log-to wandb,mlflow # offline W&B, MLflow files
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    add_config_args(p)
    add_data_arg(p)
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/PRESET[-suffix])")
    p.add_argument("--steps", type=int, help="updates per block (overrides the preset)")
    p.add_argument("--seed", type=int, help="run seed (overrides the preset)")
    add_device_arg(p, default=None)
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--block", metavar="B", help="train only these blocks (comma-separated), as a worker does"
    )
    who.add_argument(
        "--reference",
        action="store_true",
        help="train the end-to-end autoregressive reference instead",
    )
    p.add_argument(
        "--upstream",
        metavar="RUN_DIR",
        action="append",
        help="with --block under route = features: a run folder holding blocks before the "
        "trained ones, which they read frozen (repeatable; copied into the run)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    add_log_arg(p)
    add_progress_arg(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    log_backends(args)  # an unknown backend or a missing library: before anything is written
    if args.resume:
        if not args.out:
            raise ConfigError("--resume needs --out RUN_DIR")
        if args.overrides or args.seed is not None or args.block or args.reference or args.upstream:
            raise ConfigError(
                "--resume continues a run with its saved config; only --steps, --device, "
                "--data and --glob may be given"
            )
        info = read_config(Path(args.out))  # a clear error before the data is opened
        resolve_device(args.device or info.config.train.device)
        if args.steps is not None and args.steps <= 0:
            raise ConfigError(f"--steps {args.steps} must be positive")
        train, valid = splits(args.data, file_patterns(args))
        # a warning line when it differs
        check_data(Path(args.out), args.data, ("train",), file_patterns(args))
        trainer = Trainer.resume(Path(args.out), train, valid, steps=args.steps, device=args.device)
    else:
        cfg = resolve_config(args)
        resolve_device(cfg.train.device)  # before the data is opened or the run folder made
        blocks = None if args.block is None else list(parse_blocks(args.block, "--block"))
        suffix = (
            "-reference"
            if args.reference
            else (f"-block{'_'.join(map(str, blocks))}" if blocks is not None else "")
        )
        out = Path(args.out or f"runs/{cfg.preset}{suffix}")
        train, valid = splits(args.data, file_patterns(args))
        record = corpus_record(args.data, patterns=file_patterns(args))
        trainer = Trainer.create(
            cfg,
            out,
            train,
            valid,
            kind="reference" if args.reference else "blocktrain",
            blocks=blocks,
            overwrite=args.overwrite,
            upstream_from=None if args.upstream is None else [Path(p) for p in args.upstream],
        )
        write_record(out, record)  # data.json: what eval, generate and --resume compare with
    return run_and_report(trainer, args, "trained")


def run_and_report(trainer: Trainer, args: argparse.Namespace, verb: str) -> int:
    """Run `trainer` to its steps, feeding the --log-to loggers, and print its summary (JSON
    with --json), for train and distill."""
    trainer.trackers = open_trackers(
        log_backends(args), trainer.run_dir, trainer.cfg.to_dict(), trainer.step or None
    )
    try:
        summary = trainer.run(progress=not args.quiet)
    finally:
        close_trackers(trainer.trackers)
    summary["run_dir"] = str(trainer.run_dir)
    summary["data"] = read_record(trainer.run_dir)  # None for a run without data.json
    if args.json:
        print_json(summary)
    else:
        ev = summary["last_eval"] or {}
        figure = ev.get("sampler_ce", ev.get("ce"))
        line = (
            f"{verb} {trainer.run_dir} to step {summary['step']} in "
            f"{summary['wall_seconds']:.0f}s; last loss {summary['last_train'].get('loss', 0):.3f}"
        )
        if figure is not None:
            line += f"; validation CE {figure:.3f} nats/byte"
        print(line)
    return 0


def splits(
    data: str | None, patterns: FilePatterns | None = None
) -> tuple[ByteSource, ByteSource | None]:
    train = load_split(data, "train", patterns)
    try:
        valid = load_split(data, "valid", patterns)
    except DataError:  # a corpus without a validation split still trains
        valid = None
    return train, valid
