"""`blocktrain export`: assemble an aggregator's latest committed blocks into a run folder that
`blocktrain eval` and `blocktrain generate` read."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from blocktrain.cli.common import Formatter
from blocktrain.config import RunConfig
from blocktrain.errors import CheckpointError
from blocktrain.protocol.storage import StateDir
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.local import write_assembled

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


@dataclass(frozen=True)
class Exported:
    out: Path
    versions: dict[int, int]
    """The committed version of each block written."""
    rounds: dict[int, int]
    """Each block's open round (= rounds closed so far)."""
    step: int
    """Local steps per replica the slowest block has seen: its rounds x H."""


def export_state(
    state_dir: Path, out: Path, *, overwrite: bool = False, versions: dict[int, int] | None = None
) -> Exported:
    """Write `out` from the state's committed versions (the latest, or `versions`)."""
    state = StateDir(Path(state_dir))
    try:
        cfg = RunConfig.from_dict(state.run_config())
        settings = state.settings()
        ckpt.check_run_dir_free(Path(out), overwrite=overwrite)
        chosen: dict[int, int] = {}
        rounds: dict[int, int] = {}
        for b in range(state.n_blocks()):
            version, round_, _ = state.ledger.block_state(b)
            chosen[b] = versions[b] if versions is not None else version
            rounds[b] = round_
        blocks = {b: state.load_tensors(b, v) for b, v in chosen.items()}
    finally:
        state.close()
    if len(blocks) != cfg.model.blocks:
        raise CheckpointError(
            f"{state_dir} holds {len(blocks)} blocks; its config has {cfg.model.blocks}"
        )
    step = min(rounds.values()) * settings.local_steps
    write_assembled(Path(out), cfg, blocks, step)
    return Exported(Path(out), chosen, rounds, step)


def run(args: argparse.Namespace) -> int:
    info = export_state(Path(args.state), Path(args.out), overwrite=args.overwrite)
    shown = ", ".join(f"b{b}=v{v}" for b, v in info.versions.items())
    print(
        f"exported {args.state} to {info.out} (versions {shown}; {info.step} local steps per "
        "replica)"
    )
    return 0
