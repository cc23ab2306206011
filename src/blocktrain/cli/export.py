"""`blocktrain export`: assemble an aggregator's latest committed blocks into a run folder that
`blocktrain eval` and `blocktrain generate` read (--out), and write a run or an aggregator's
blocks in the Hugging Face Hub layout (--hf): config.json, model.safetensors and a README.md
model card with the training table, which `blocktrain.from_pretrained(DIR)`, `blocktrain eval
DIR` and `blocktrain generate DIR` read back."""

from __future__ import annotations

import argparse
from pathlib import Path

from blocktrain.cli.common import Formatter
from blocktrain.errors import ConfigError
from blocktrain.protocol.store.state import read_committed
from blocktrain.training import card, hub
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.local import (
    assembled_tensors,
    reference_tensors,
    write_assembled,
    write_reference,
)

EXAMPLES = """examples:
  blocktrain export --state runs/agg --out runs/agg-model     # an aggregator's blocks, a run folder
  blocktrain eval runs/agg-model --split test
  blocktrain export --run runs/tiny --hf hf/tiny              # a train run, in the Hub layout
  blocktrain export --run runs/cluster/model --hf hf/cluster  # a cluster's model (its summary's CE)
  blocktrain export --state runs/agg --hf hf/agg              # an aggregator's blocks, Hub layout
  blocktrain generate hf/tiny --prompt "The " --bytes 200     # eval and generate read an export
  python -c 'import blocktrain; print(blocktrain.from_pretrained("hf/tiny"))'
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="assemble the aggregator's blocks into a run folder, or write the Hub layout",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--state", metavar="DIR", help="an aggregator's state folder")
    source.add_argument(
        "--run", metavar="RUN_DIR", help="a run folder (train, distill, or a cluster's model/)"
    )
    p.add_argument("--out", metavar="RUN_DIR", help="the run folder to write (with --state)")
    p.add_argument(
        "--hf",
        metavar="DIR",
        help="the Hugging Face folder to write: config.json, model.safetensors, README.md (and "
        "data.json when the run has one); other files of DIR, such as a clone's .git, stay",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out/--hf")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.run and args.out:
        raise ConfigError("--run is a run folder already: give --hf DIR to export it")
    if not args.out and not args.hf:
        raise ConfigError("give --out RUN_DIR (a run folder) or --hf DIR (the Hub layout)")
    if args.run:
        hub.export_run(Path(args.run), Path(args.hf), overwrite=args.overwrite)
        print(f"exported {args.run} to {args.hf} (Hugging Face layout)")
        return 0
    return _export_state(args)


def _export_state(args: argparse.Namespace) -> int:
    if args.out:
        ckpt.check_run_dir_free(Path(args.out), overwrite=args.overwrite, resumable=False)
    if args.hf:
        hub.check_hf_dir_free(Path(args.hf), overwrite=args.overwrite)
    info = read_committed(Path(args.state))
    reference = info.unit == "reference"  # a DiLoCo run: its one unit is the end-to-end model
    if args.out:
        if reference:
            write_reference(Path(args.out), info.cfg, info.blocks[0], info.step)
        else:
            write_assembled(Path(args.out), info.cfg, info.blocks, info.step)
    if args.hf:
        tensors = (
            reference_tensors(info.cfg, info.blocks[0])
            if reference
            else assembled_tensors(info.cfg, info.blocks)
        )
        run_info = ckpt.RunInfo(
            info.cfg,
            "reference" if reference else "blocktrain",
            [] if reference else list(range(info.cfg.model.blocks)),
        )
        facts = card.state_facts(Path(args.state), info.step, info.versions)
        hub.write_hf(Path(args.hf), run_info, tensors, facts, None)
    shown = ", ".join(f"b{b}=v{v}" for b, v in info.versions.items())
    where = " and ".join(
        [
            *([str(args.out)] if args.out else []),
            *([f"{args.hf} (Hugging Face layout)"] if args.hf else []),
        ]
    )
    print(
        f"exported {args.state} to {where} (versions {shown}; {info.step} local steps per replica)"
    )
    return 0
