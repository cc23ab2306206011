"""How far one replica's honest update moves when it is recomputed on other CPU kernels: the
number that would set the tolerance of recomputation on a sample (docs/protocol.md,
Aggregation, "Recomputation on a sample is not built"). Writes
benchmarks/results/recompute_spread.json and the "recompute-spread" section of BENCHMARKS.md.

One replica of block 0 (the preset, its `data_seed`) trains --rounds rounds of H local steps
from the initial block, each round from the last round's weights with its AdamW moments
carried over, as a worker does, on this machine's default kernels. Then, each in a fresh
process, against that trajectory, per round ||delta - delta_default|| / ||delta_default||:

    rerun            the same kernels again
    avx2_one_round   AVX2 kernels forced (ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2,
                     ONEDNN_MAX_CPU_ISA=AVX2), each round from the default trajectory's state
                     at its start (weights and moments): what a verifier re-running one round
                     from the worker's state would see
    avx2_trajectory  AVX2 kernels, every round from its own last round: what a verifier
                     re-running a worker's history from its registration would see

(On an AVX2 machine the forced kernels are its default, and both AVX2 rows are reruns.)

    python bench/recompute_spread.py              # tiny, 5 rounds of H = 10: ~1 min here
    python bench/recompute_spread.py --preset small --rounds 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from blocktrain.data import resolve_data_path
from blocktrain.data.corpus import load_split
from blocktrain.presets import PRESETS, preset
from blocktrain.training.local import initial_blocks, local_trainer
from report import machine, update_section, write_json  # bench/report.py

AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
RUNS = {
    "rerun": ({}, False),
    "avx2_one_round": (AVX2, True),
    "avx2_trajectory": (AVX2, False),
}
"""Against the default kernels' trajectory: (kernel settings, whether each round starts from
the default trajectory's state at that round, weights and AdamW moments, or from its own)."""


def replica(name: str, rounds: int, local_steps: int, out: Path, starts: Path | None) -> None:
    """One replica's rounds into `out`: each round's delta (`d.R.*`), and the state it started
    from (`w.R.*` weights, `o.R.*` AdamW moments). With `starts` (a file this wrote), each round
    starts from the state named there instead of the last round's own."""
    torch.set_num_threads(1)  # the same reduction order in every process
    cfg = preset(name)
    train = load_split(None, "train")
    given = load_file(str(starts)) if starts is not None else None
    trainer = local_trainer(cfg, "block", 0, train, data_seed=cfg.seed * 6)
    weights = {k: v.float().clone() for k, v in initial_blocks(cfg)[0].items()}
    saved: dict[str, torch.Tensor] = {}
    for r in range(rounds):
        if given is not None:  # a fresh trainer from the given state
            trainer = local_trainer(cfg, "block", 0, train, data_seed=cfg.seed * 6)
            weights = part(given, f"w.{r}.")
            moments = part(given, f"o.{r}.")
            trainer.load(weights)
            if moments:
                trainer.load_optimizer_state(moments, steps_done=r * local_steps)
        else:
            saved.update({f"o.{r}.{k}": v.detach().clone() for k, v in moments_of(trainer)})
            trainer.load(weights)
        saved.update({f"w.{r}.{k}": v.detach().clone() for k, v in weights.items()})
        trainer.train(local_steps, r * local_steps, lambda: False)
        delta = trainer.delta()
        saved.update({f"d.{r}.{k}": v.float().clone() for k, v in delta.items()})
        weights = {k: weights[k] + delta[k].float() for k in weights}
    save_file(saved, str(out))


def moments_of(trainer: Any) -> list[tuple[str, torch.Tensor]]:
    """The trainer's AdamW state (none before its first step)."""
    return list(trainer.optimizer_state().items()) if trainer.steps_done else []


def part(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def flat(deltas: dict[str, torch.Tensor], r: int) -> torch.Tensor:
    """Round r's delta, every tensor, as one vector."""
    d = part(deltas, f"d.{r}.")
    return torch.cat([d[k].flatten() for k in sorted(d)])


def delta_norm(deltas: dict[str, torch.Tensor], r: int) -> float:
    return float(flat(deltas, r).norm())


def spread(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rounds: int) -> list[float]:
    """||delta_a - delta_b|| / ||delta_a||, per round."""
    return [float((flat(a, r) - flat(b, r)).norm()) / delta_norm(a, r) for r in range(rounds)]


def markdown(result: dict[str, Any]) -> str:
    sp = result["spread"]
    lines = [
        f"`{result['command']}`; JSON: `benchmarks/results/recompute_spread.json`. One replica "
        f"of block 0 at {result['preset']}, {result['rounds']} rounds of H = "
        f"{result['local_steps']} (AdamW moments carried over) on the default kernels "
        f"({result['machine'].get('cpu', 'this CPU')}), computed again; each round's delta's "
        "relative difference from the default one's.",
        "",
        "| round | delta norm | rerun, same kernels | AVX2, one round from the same state "
        "| AVX2, its own trajectory |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in range(result["rounds"]):
        lines.append(
            f"| {r} | {result['delta_norm'][r]:.3f} | {sp['rerun'][r]:.1e} "
            f"| {sp['avx2_one_round'][r]:.1e} | {sp['avx2_trajectory'][r]:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="(default: tiny)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the replica (default: 5)")
    p.add_argument("--local-steps", type=int, default=10, help="H (default: 10)")
    p.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one process's part
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--starts", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 1 or args.local_steps < 1:
        p.error("--rounds and --local-steps must be positive")
    if args.worker:
        replica(args.preset, args.rounds, args.local_steps, args.out, args.starts)
        return
    data = str(resolve_data_path(args.data))
    runs: dict[str, dict[str, torch.Tensor]] = {}
    with tempfile.TemporaryDirectory(prefix="recompute-") as tmp:
        default = Path(tmp) / "default.safetensors"
        for name, (env, from_default) in {"default": ({}, False), **RUNS}.items():
            print(f"recompute_spread: {name} ...", file=sys.stderr, flush=True)
            out = Path(tmp) / f"{name}.safetensors"
            starts = ["--starts", str(default)] if from_default else []
            subprocess.run(
                [sys.executable, __file__, "--worker", "--out", str(out), "--preset", args.preset,
                 "--rounds", str(args.rounds), "--local-steps", str(args.local_steps), *starts],
                env={**os.environ, "BLOCKTRAIN_DATA": data, **env},
                check=True,
            )  # fmt: skip
            runs[name] = load_file(str(out))
    base = runs["default"]
    result = {
        "command": "python bench/recompute_spread.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "delta_norm": [delta_norm(base, r) for r in range(args.rounds)],
        "spread": {k: spread(base, runs[k], args.rounds) for k in RUNS},
        "machine": machine(),
    }
    result["command"] = result["command"].strip()
    write_json("recompute_spread.json", result)
    update_section("recompute-spread", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
