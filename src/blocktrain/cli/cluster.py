"""`blocktrain cluster`: a decentralised run on this machine: the aggregator and N worker
processes over real HTTP on loopback, then the from-noise CE of every round's committed model.

Writes OUT/state (the aggregator's state folder, every version kept), OUT/logs, OUT/model (the
final assembled run folder, for `blocktrain eval` and `generate`) and OUT/summary.json: rounds,
participation per block, bytes moved against the minimum, from-noise CE per round, final CE.
Every worker here is the user's own, so the aggregator's effect probe is off unless
`--effect-probe on`, and rounds have a 60 s deadline unless `--deadline`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from blocktrain.cli.common import (
    Formatter,
    add_config_args,
    add_data_arg,
    add_progress_arg,
    add_setting_args,
    add_unit_arg,
    file_patterns,
    print_json,
    progress_bar,
    resolve_rounds_config,
    settings_overrides,
    unit_of,
)
from blocktrain.config import RunConfig
from blocktrain.data import load_split, resolve_data_path
from blocktrain.errors import ConfigError
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.model import init_reference
from blocktrain.protocol.ops.cluster import run_cluster
from blocktrain.protocol.store.state import bytes_summary, create_state, round_versions
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.training import EvalSettings, evaluate_blocktrain, evaluate_reference
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.local import (
    build_stack,
    initial_units,
    reference_config,
    write_assembled,
    write_reference,
)

EXAMPLES = """examples:
  blocktrain cluster --workers 6 --preset tiny --rounds 30 --out runs/cluster
  blocktrain cluster --workers 3 --preset tiny --rounds 10 --local-steps 20 --deadline 30 \\
      --out runs/c3 --set d_model=64
  blocktrain eval runs/cluster/model --split test
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster",
        help="run an aggregator and N workers on this machine",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("--workers", type=int, required=True, metavar="N", help="worker processes")
    add_config_args(p)
    add_unit_arg(p)
    add_data_arg(p)
    p.add_argument("--rounds", type=int, required=True, metavar="R", help="rounds per block")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--seed", type=int, help="run seed (overrides the preset)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--eval-bytes", type=int, default=8192, help="validation bytes for the per-round CE"
    )
    p.add_argument("--eval-sweeps", type=int, default=2, help="sweeps M for the per-round CE")
    p.add_argument(
        "--final-bytes",
        type=int,
        default=32768,
        help="validation bytes for the final CE (as `blocktrain eval`)",
    )
    p.add_argument("--final-sweeps", type=int, default=16, help="sweeps M for the final CE")
    p.add_argument(
        "--timeout", type=float, default=3600.0, metavar="S", help="give up after S seconds"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    add_progress_arg(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_setting_args(p, defaults=CLUSTER_DEFAULTS)
    p.set_defaults(handler=run)


CLUSTER_DEFAULTS = {"deadline_s": 60.0, "effect_probe": "off", "min_round_s": 0.0}
"""Settings that differ here from a public aggregator's: short rounds, no effect probe and no
minimum round length, since every worker of a cluster is the user's own: the probe refuses
honest updates near the learning rate's peak (BENCHMARKS.md, The shared-node run;
`--effect-probe on` to have it), and a minimum round only holds back workers that are done."""


PARTICIPATION_KEYS = (
    "round",
    "accepted",
    "in_time",
    "refused",
    "expected",
    "reported",
    "cause",
    "participation",
    "duration_s",
)


def _check_args(args: argparse.Namespace) -> None:
    for name in (
        "workers",
        "rounds",
        "threads",
        "eval_bytes",
        "eval_sweeps",
        "final_bytes",
        "final_sweeps",
    ):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if args.timeout <= 0:
        raise ConfigError("--timeout must be positive")


def evaluate_units(
    cfg: RunConfig,
    unit: str,
    weights: dict[int, dict[str, torch.Tensor]],
    windows: torch.Tensor,
    settings: EvalSettings,
) -> dict[str, Any]:
    """The assembled stack's metrics, or a reference unit's exact CE as both of its CEs."""
    if unit == "reference":
        model = init_reference(cfg.model, cfg.seed).eval()
        model.load_state_dict({k: v.float() for k, v in weights[0].items()})
        ev = evaluate_reference(model, windows, settings)
        return {**ev, "from_noise_ce": ev["ce"], "sampler_ce": ev["ce"]}  # no sweeps: exact
    return evaluate_blocktrain(build_stack(cfg, weights), windows, settings)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    out = Path(args.out)
    if (out / "state").exists() or (out / "summary.json").exists():
        if not args.overwrite:
            raise ConfigError(
                f"{out} already holds a cluster run; pass --overwrite or choose another --out"
            )
        for name in ("state", "logs", "model"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / "summary.json").unlink(missing_ok=True)
    data_path = str(resolve_data_path(args.data))
    patterns = file_patterns(args)
    valid = load_split(data_path, "valid", patterns)
    overrides = {**CLUSTER_DEFAULTS, **settings_overrides(args)}
    local_steps = overrides.get("local_steps", 10)
    unit = unit_of(args)
    cfg = resolve_rounds_config(args, local_steps)
    if unit == "reference":
        cfg = reference_config(cfg)
    overrides.update(
        {
            "max_rounds": args.rounds,
            "keep_versions": 0,
            "n_workers": args.workers,
            "local_steps": local_steps,
        }
    )
    state = create_state(out / "state", cfg, overrides, initial_units(cfg, unit), unit)
    tokens = []
    for i in range(args.workers):
        tokens.append(new_token())
        state.ledger.add_token(f"worker-{i}", hash_token(tokens[-1]), time.time())
    observer = new_token()
    state.ledger.add_token("cluster", hash_token(observer), time.time())

    bar = progress_bar(
        args,
        total=args.rounds * cfg.model.blocks,
        unit="round",
        desc=f"cluster {args.workers} workers",
    )

    def progress(status: dict[str, Any]) -> None:
        bar.n = sum(min(r, args.rounds) for r in status["rounds"])
        bar.set_postfix(
            versions=",".join(map(str, status["versions"])),
            live=status["workers"]["live"],
            refresh=False,
        )
        bar.refresh()

    result = run_cluster(
        state,
        tokens,
        observer,
        out / "logs",
        data=data_path,
        data_patterns=patterns.argv(),
        threads=args.threads,
        timeout_s=args.timeout,
        on_status=progress,
    )
    bar.close()

    windows = valid.windows(cfg.model.seq_len, args.eval_bytes)
    versions = round_versions(state, args.rounds)
    per_round = []
    for r, chosen in enumerate(versions):  # same bytes and noise every round
        weights = {b: state.load_tensors(b, v) for b, v in chosen.items()}
        ev = evaluate_units(
            cfg, unit, weights, windows, EvalSettings(sweeps=args.eval_sweeps, seed=cfg.seed)
        )
        per_round.append(
            {"round": r, "from_noise_ce": ev["from_noise_ce"], "sampler_ce": ev["sampler_ce"]}
        )
    final_blocks = {b: state.load_tensors(b, v) for b, v in versions[-1].items()}
    ckpt.check_run_dir_free(out / "model", overwrite=True)
    if unit == "reference":
        write_reference(out / "model", cfg, final_blocks[0], args.rounds * local_steps)
    else:
        write_assembled(out / "model", cfg, final_blocks, args.rounds * local_steps)
    final_windows = valid.windows(cfg.model.seq_len, args.final_bytes)
    final = evaluate_units(
        cfg, unit, final_blocks, final_windows, EvalSettings(sweeps=args.final_sweeps, seed=0)
    )
    status = result.status
    wire = {b["block"]: b["pull_bytes"] for b in status["blocks"]}
    pushed = {b["block"]: b["delta_bytes"] for b in status["blocks"]}
    summary = {
        "preset": cfg.preset,
        "unit": unit,
        "workers": args.workers,
        "rounds": args.rounds,
        "local_steps": local_steps,
        "worker_steps_per_replica": args.rounds * local_steps,
        "deadline_s": state.settings().deadline_s,
        "wire_dtype": state.settings().wire_dtype,
        "delta_wire": state.settings().push_wire,
        "pull_wire": state.settings().pulls,
        "effect_probe": state.settings().effect_probe,
        "rule": state.settings().rule,
        "wall_seconds": result.wall_seconds,
        "blocks": cfg.model.blocks,
        "params_per_block": status["blocks"][0]["params"],
        "replicas_per_block": status["workers"]["per_block"],
        "participation": {
            b: [{k: r[k] for k in PARTICIPATION_KEYS} for r in rounds]
            for b, rounds in status["participation"].items()
        },
        "participation_mean": {
            b: sum(r["participation"] for r in rounds) / len(rounds)
            for b, rounds in status["participation"].items()
            if rounds
        },
        "updates": status["updates"],
        "bytes": bytes_summary(status, wire, pushed),
        "from_noise_ce_per_round": [r["from_noise_ce"] for r in per_round],
        "sampler_ce_per_round": [r["sampler_ce"] for r in per_round],
        "per_round_eval": {
            "bytes": int(windows.numel()),
            "sweeps": args.eval_sweeps,
            "split": "valid",
        },
        "final": {
            k: final.get(k)
            for k in (
                "sampler_ce",
                "from_noise_ce",
                "ce_per_step",
                "oracle_ce",
                "bits_per_byte",
                "sweeps",
                "bytes",
            )
        },
        "final_eval": {
            "split": "valid",
            "bytes": args.final_bytes,
            "sweeps": args.final_sweeps,
            "seed": 0,
        },
        "workers_report": result.workers,
        "exit_codes": result.exit_codes,
        "model": str(out / "model"),
        "config": cfg.to_dict(),
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    state.close()
    if args.json:
        print_json(summary)
    else:
        ce = summary["from_noise_ce_per_round"]
        print(
            f"cluster of {args.workers} workers: {args.rounds} rounds in "
            f"{result.wall_seconds:.0f}s; from-noise CE {ce[0]:.3f} -> {ce[-1]:.3f}; final "
            f"sampler CE {final['sampler_ce']:.3f} (M = {args.final_sweeps}); bytes "
            f"{summary['bytes']['total'] / 1e6:.1f} MB ({summary['bytes']['ratio_to_minimum']:.3f}"
            f"x the minimum); summary in {out / 'summary.json'}"
        )
    return 0
