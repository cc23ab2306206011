"""The evaluation after a `blocktrain cluster`'s rounds, run while the aggregator still serves the
dashboard: each round's model and the final one, scored on the validation split, and the run's
summary (summary.json). `--log-to` gets the same figures as metrics records, at step = the rounds
done (README.md, "Experiment logging")."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blocktrain.cli.common import progress_bar
from blocktrain.config import RunConfig
from blocktrain.protocol.store.state import bytes_summary, round_versions
from blocktrain.training import EvalSettings
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.local import evaluate_units, write_assembled, write_reference

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


ROUND_KEYS = (
    "accepted",
    "in_time",
    "refused",
    "expected",
    "reported",
    "participation",
    "duration_s",
    "version",
)
"""What a committed round's record holds of the status's participation row."""


def round_records(
    status: dict[str, Any], logged: dict[str, int], losses: Callable[[], dict[Any, float]]
) -> list[dict[str, Any]]:
    """The rounds of `status` closed since the last one `logged` has of their block (block -> round;
    updated) as metrics records; `losses()`, asked only when there are some, gives (block, round)
    -> the mean loss the round's accepted updates reported."""
    fresh = [
        (b, row)
        for b, rows in sorted(status["participation"].items(), key=lambda item: int(item[0]))
        for row in sorted(rows, key=lambda r: r["round"])
        if row["round"] > logged.get(b, -1)
    ]
    mean_loss = losses() if fresh else {}
    records = []
    for b, row in fresh:
        logged[b] = row["round"]
        values = {k: row[k] for k in ROUND_KEYS if k in row}
        values["loss"] = mean_loss.get((int(b), row["round"]))
        records.append({"event": "rounds", "step": row["round"] + 1, f"block{b}": values})
    return records


def evaluation_records(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """A cluster summary's evaluations as metrics records: each round's model, then the final."""
    per_round = zip(
        summary["from_noise_ce_per_round"], summary["sampler_ce_per_round"], strict=True
    )
    records: list[dict[str, Any]] = [
        {"event": "eval", "split": "valid", "step": r, "from_noise_ce": fn, "sampler_ce": sc}
        for r, (fn, sc) in enumerate(per_round)
    ]
    final = {k: v for k, v in summary["final"].items() if k not in ("sweeps", "bytes")}
    records.append({"event": "eval", "split": "final", "step": summary["rounds"], **final})
    return records


def replicas_per_block(state: Any) -> list[int]:
    """The workers (by name: one that registered again is the same one) that trained each
    block, from the ledger: the status's `workers.per_block` counts the live ones only, and every
    worker leaves once its block is done."""
    names: list[set[str]] = [set() for _ in range(state.n_blocks())]
    for w in state.ledger.workers(active_only=False):
        names[w.block].add(w.name or f"#{w.id}")
    return [len(n) for n in names]


def say(line: str) -> None:
    """A line of the cluster's progress, on stderr."""
    print(f"cluster: {line}", file=sys.stderr, flush=True)


def evaluate_cluster(
    args: argparse.Namespace,
    cfg: RunConfig,
    unit: str,
    state: Any,
    valid: Any,
    local_steps: int,
    out: Path,
    status: dict[str, Any],
    device: torch.device | str = "cpu",
) -> tuple[dict[str, Any], str]:
    """Each round's from-noise CE, the final model and its CE: the summary (without the
    processes' fields), and the end of the line that reports it."""
    windows = valid.windows(cfg.model.seq_len, args.eval_bytes)
    versions = round_versions(state, args.rounds)
    say(
        f"evaluating {len(versions)} models, the first and the one after each round "
        f"({int(windows.numel())} bytes, M = {args.eval_sweeps}); the dashboard stays up until "
        "the evaluation ends"
    )
    lines = not args.quiet  # a line per round where no bar is drawn (a log, a pipe)
    rounds_bar = progress_bar(args, total=len(versions), unit="round", desc="eval rounds")
    lines = lines and bool(rounds_bar.disable)
    per_round = []
    for r, chosen in enumerate(versions):  # same bytes and noise every round
        weights = {b: state.load_tensors(b, v) for b, v in chosen.items()}
        ev = evaluate_units(
            cfg,
            unit,
            weights,
            windows,
            EvalSettings(sweeps=args.eval_sweeps, seed=cfg.seed),
            device=device,
        )
        per_round.append(
            {"round": r, "from_noise_ce": ev["from_noise_ce"], "sampler_ce": ev["sampler_ce"]}
        )
        rounds_bar.update(1)
        rounds_bar.set_postfix(ce=f"{ev['from_noise_ce']:.3f}", refresh=False)
        if lines:
            say(f"after round {r} of {len(versions) - 1}: from-noise CE {ev['from_noise_ce']:.3f}")
    rounds_bar.close()
    final_blocks = {b: state.load_tensors(b, v) for b, v in versions[-1].items()}
    ckpt.check_run_dir_free(out / "model", overwrite=True)
    if unit == "reference":
        write_reference(out / "model", cfg, final_blocks[0], args.rounds * local_steps)
    else:
        write_assembled(out / "model", cfg, final_blocks, args.rounds * local_steps)
    final_windows = valid.windows(cfg.model.seq_len, args.final_bytes)
    say(
        f"final evaluation of {out / 'model'} ({int(final_windows.numel())} bytes, "
        f"M = {args.final_sweeps})"
    )
    final_bar = progress_bar(
        args, total=int(final_windows.shape[0]), unit="window", desc="final eval"
    )
    final = evaluate_units(
        cfg,
        unit,
        final_blocks,
        final_windows,
        EvalSettings(sweeps=args.final_sweeps, seed=0),
        progress=final_bar.update,
        device=device,
    )
    final_bar.close()

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
        "wall_seconds": None,  # the caller's: the rounds' wall time
        "blocks": cfg.model.blocks,
        "params_per_block": status["blocks"][0]["params"],
        "replicas_per_block": replicas_per_block(state),
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
        "workers_report": None,  # the caller's, with the exit codes
        "exit_codes": None,
        "model": str(out / "model"),
        "config": cfg.to_dict(),
    }
    ce = summary["from_noise_ce_per_round"]
    line = (
        f"from-noise CE {ce[0]:.3f} -> {ce[-1]:.3f}; final sampler CE {final['sampler_ce']:.3f} "
        f"(M = {args.final_sweeps}); bytes {summary['bytes']['total'] / 1e6:.1f} MB "
        f"({summary['bytes']['ratio_to_minimum']:.3f}x the minimum); summary in "
        f"{out / 'summary.json'}"
    )
    return summary, line
