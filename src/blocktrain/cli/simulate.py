"""`blocktrain simulate`: the decentralised protocol in one process, on a virtual clock.

N virtual workers (each assigned a block, as the aggregator assigns them) pull, train H real
local steps, and push their deltas through the protocol's own round state machine, validators
and aggregation. How long each step, message and transfer takes, and who drops out, is drawn
from a participation regime; nothing sleeps, so 30 rounds of a WAN take the compute of 30 rounds.
Several regimes run side by side from the same initial weights, data and seeds.

Regimes: lockstep (every update arrives), mild (about 90% arrive before the deadline), wan
(about 42%), or a .json/.toml file (see `blocktrain.simulate.regimes`). They spread the seconds
of a device profile (--profile): a local step takes its block's FLOPs over the profile's
sustained FLOP/s, a message its bytes over the profile's link plus its latency.

Writes OUT/simulate.json (everything), OUT/REGIME/rounds.jsonl (one record per round: virtual
time, accepted and refused updates per block with reasons, participation, from-noise CE),
OUT/REGIME/weights.safetensors (the final blocks) and OUT/ce.png (CE against rounds and against
virtual time).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blocktrain.cli.common import (
    Formatter,
    add_config_args,
    add_data_arg,
    add_progress_arg,
    add_setting_args,
    add_threads_arg,
    file_patterns,
    print_json,
    progress_bar,
    resolve_rounds_config,
    settings_overrides,
    use_threads,
)
from blocktrain.data import load_split, resolve_data_path
from blocktrain.data.provenance import corpus_record
from blocktrain.errors import ConfigError
from blocktrain.simulate import SimSpec, parse_regimes, simulate, write_outputs
from blocktrain.simulate.attacks import Attack
from blocktrain.simulate.run import table
from blocktrain.training.profiles import PROFILES, device_profile

EXAMPLES = """examples:
  blocktrain simulate --preset tiny --workers 6 --rounds 30 --regime lockstep,mild,wan \\
      --out runs/sim
  blocktrain simulate --workers 6 --rounds 30 --regime wan --staleness 1 --json
  blocktrain simulate --workers 12 --rounds 50 --regime mild,my-regime.toml --timing-only
  blocktrain simulate --regime wan --profile consumer-gpu --timing-only --set route=relay
  blocktrain simulate --regime lockstep --rounds 10 --set attack=shrink:4:0   # 4 attackers, block 0
  blocktrain simulate --regime lockstep --set attack=noise clip=0 --effect-probe off
  blocktrain simulate --timing-only --set slowdown=5:3 pacing=adaptive   # worker 5 3x slower
  blocktrain simulate --regime lockstep --rounds 10 --wire topk:0.1   # compressed deltas
  blocktrain simulate --set unit=reference layers=3 --outer-lr 0.7 --outer-momentum 0.9 \\
      --effect-probe off            # DiLoCo: end-to-end replicas, outer Nesterov
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate decentralised training under participation regimes (one process)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    add_config_args(p)
    add_data_arg(p)
    p.add_argument("--workers", type=int, default=6, metavar="N", help="virtual workers")
    p.add_argument("--rounds", type=int, default=30, metavar="R", help="rounds per block")
    p.add_argument(
        "--regime",
        default="lockstep,mild,wan",
        metavar="NAMES",
        help="comma-separated regimes: lockstep, mild, wan or .json/.toml files",
    )
    p.add_argument("--seed", type=int, help="run seed (overrides the preset's)")
    p.add_argument(
        "--profile",
        default="cpu",
        metavar="NAME",
        help=f"the device every virtual worker trains on: {', '.join(PROFILES)} "
        "(training/profiles.py)",
    )
    p.add_argument("--out", metavar="DIR", help="write records, weights and the plot here")
    p.add_argument(
        "--eval-bytes", type=int, default=4096, help="validation bytes for the per-round CE"
    )
    p.add_argument(
        "--eval-every", type=int, default=1, metavar="K", help="measure the CE every K rounds"
    )
    p.add_argument(
        "--final-sweeps", type=int, default=16, metavar="M", help="sweeps for the final sampler CE"
    )
    p.add_argument(
        "--final-bytes",
        type=int,
        default=16384,
        help="validation bytes for the final sampler CE",
    )
    p.add_argument(
        "--timing-only",
        action="store_true",
        help="no training: zero deltas, to measure a regime's participation in seconds",
    )
    add_threads_arg(p)
    add_progress_arg(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_setting_args(
        p,
        "protocol settings (virtual seconds)",
        simulated_only=True,
        own=SIM_SETTINGS,
        own_doc="docs/simulate.md, Simulation settings",
    )
    p.set_defaults(handler=run)


SIM_SETTINGS: dict[str, type] = {"attack": str, "unit": str, "slowdown": str}
"""The `SimSpec` fields that simulate's --set takes by name (docs/simulate.md, "Simulation
settings"): attack=KIND[:COUNT[:BLOCK]][:shared] adds hostile workers (none by default); unit=block
or unit=reference (DiLoCo: the end-to-end reference of `layers` layers as one unit; default
block); slowdown=ID:FACTOR[,...] makes honest workers slower (none by default)."""


def _slowdown(text: str) -> dict[int, float]:
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(worker): float(factor) for worker, factor in pairs}
    except ValueError:
        raise ConfigError(f"--set slowdown={text}: expected ID:FACTOR[,ID:FACTOR...]") from None


def run(args: argparse.Namespace) -> int:
    regimes = parse_regimes(args.regime)
    profile = device_profile(args.profile)
    use_threads(args)
    protocol = settings_overrides(args)
    attack = protocol.pop("attack", None)
    unit = protocol.pop("unit", "block")
    slowdown = _slowdown(protocol.pop("slowdown", ""))
    local_steps = int(protocol.get("local_steps", 10))
    cfg = resolve_rounds_config(args, local_steps)
    spec = SimSpec(
        cfg,
        args.workers,
        args.rounds,
        protocol,
        seed=cfg.seed,
        eval_bytes=args.eval_bytes,
        eval_every=args.eval_every,
        final_sweeps=args.final_sweeps,
        final_bytes=args.final_bytes,
        timing_only=args.timing_only,
        attack=None if attack is None else Attack.parse(attack),
        unit=unit,
        slowdown=slowdown,
        profile=profile,
    )
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if out is not None and (out / "simulate.json").exists():
        raise ConfigError(f"{out} already holds a simulation; choose another --out")
    train = valid = record = None
    if not args.timing_only:
        data = resolve_data_path(args.data)
        patterns = file_patterns(args)
        train, valid = load_split(data, "train", patterns), load_split(data, "valid", patterns)
        record = corpus_record(data, patterns=patterns)

    bars: dict[str, Any] = {}

    def progress(name: str, done: int, total: int) -> None:
        bar = bars.get(name)
        if bar is None:
            bar = bars[name] = progress_bar(
                args, total=total, desc=f"simulate {name}", unit="round", leave=True
            )
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    report, weights = simulate(spec, regimes, train, valid, progress=progress)
    report["data"] = record  # the corpus, as a train run's data.json records it (None: timing only)
    for bar in bars.values():
        bar.close()
    if out is not None:
        report["outputs"] = [str(p) for p in write_outputs(out, report, weights)]
    if args.json:
        print_json(report)
    else:
        print(table(report))
        if out is not None:
            print(f"records, weights and the plot: {out}")
    return 0
