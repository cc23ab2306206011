"""How honest and forged updates read on the effect probe, by probe step (docs/protocol.md,
Effect probe): the evidence behind `probe_step` and `probe_z`.

One simulator run (6 honest workers, lockstep, real local training) in which the probe accepts
every honest update (probe_z at its maximum: the trajectory of a run the probe never starves),
Every honest update is read at each step S in --steps (the slice's loss at w + S x delta against
w, window by window); once per block and round, so are the forged updates of
bench/adversarial.py (shrink, bias, noise at the norm bound) from the same weights. Each reading
is the paired test's t = (relative change) / (its standard error): negative when the update
lowers the loss. A rule that accepts t < z at step S keeps an honest run at full speed if the
honest t stay below z, and refuses the forged ones if theirs stay above it.

Writes benchmarks/results/probe_effects.json and the "probe-effects" section of BENCHMARKS.md.

    python bench/probe_effects.py --preset small --rounds 20 --local-steps 10
    python bench/probe_effects.py --rounds 3 --local-steps 2     # tiny: that it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.presets import PRESETS, preset
from blocktrain.protocol.core import effect as effect_module
from blocktrain.protocol.core.bounds import delta_norm_bound, largest_block
from blocktrain.simulate import SimSpec, simulate
from blocktrain.simulate.attacks import KINDS, ForgingTrainer
from blocktrain.simulate.regimes import load_regime
from blocktrain.training.local import initial_blocks
from report import machine, update_section, write_json

RESULT = "probe_effects.json"
Tensors = dict[str, torch.Tensor]


class Recorder:
    """Wraps `ProbeCache.effect`: the verdict's own reading (at the run's probe step, 1 here),
    plus each update's reading at every step in `steps` and the forged updates', recorded."""

    def __init__(self, steps: list[float], bound: float, replicas: int) -> None:
        self.steps, self.bound, self.replicas = steps, bound, replicas
        self.original = effect_module.ProbeCache.effect
        self.honest: list[dict[str, Any]] = []
        self.forged: list[dict[str, Any]] = []
        self.seen: dict[int, int] = {}  # block -> updates read

    def install(self) -> None:
        original, recorder = self.original, self

        def effect(
            cache: effect_module.ProbeCache,
            block: int,
            weights: Tensors,
            delta: Tensors,
            others: Mapping[int, Tensors],
            step: float = 1.0,
        ) -> effect_module.Effect:
            n = recorder.seen.get(block, 0)
            recorder.seen[block] = n + 1
            rnd = n // recorder.replicas
            recorder.honest.append(
                {
                    "block": block,
                    "round": rnd,
                    "t": recorder.read(cache, block, weights, delta, others),
                }
            )
            if n % recorder.replicas == 0:
                for kind in KINDS:
                    forger = ForgingTrainer(kind, recorder.bound, 1, seed=block * 1000 + rnd)
                    forger.load(weights)
                    t = recorder.read(cache, block, weights, forger.delta(), others)
                    recorder.forged.append({"block": block, "round": rnd, "kind": kind, "t": t})
            return original(cache, block, weights, delta, others, step)

        effect_module.ProbeCache.effect = effect  # type: ignore[method-assign]

    def read(
        self,
        cache: effect_module.ProbeCache,
        block: int,
        weights: Tensors,
        delta: Tensors,
        others: Mapping[int, Tensors],
    ) -> dict[str, float]:
        out = {}
        for s in self.steps:
            e = self.original(cache, block, weights, delta, others, s)
            out[f"{s:g}"] = e.relative / e.stderr if e.stderr > 0 else 0.0
        return out


def summary(rows: list[dict[str, Any]], steps: list[float]) -> dict[str, Any]:
    """Per step: honest t (max, median, share below 0, 1 and 2) and each forged kind's min t,
    over the whole run and its second half (where honest gains fade)."""
    last_round = max((r["round"] for r in rows), default=0)
    out: dict[str, Any] = {}
    for s in map(lambda v: f"{v:g}", steps):
        entry: dict[str, Any] = {}
        for part, keep in (
            ("all", lambda r: True),
            ("late", lambda r: 2 * r["round"] > last_round),
        ):
            ts = [r["t"][s] for r in rows if "kind" not in r and keep(r)]
            if not ts:
                continue
            entry[part] = {
                "honest_max_t": max(ts),
                "honest_median_t": statistics.median(ts),
                **{f"honest_below_{z}": sum(t < z for t in ts) / len(ts) for z in (0, 1, 2)},
                **{
                    f"{kind}_min_t": min(
                        (
                            r["t"][s]
                            for r in rows
                            if r.get("kind") == kind and keep(r) and r["round"] > 0
                        ),
                        default=None,
                    )
                    for kind in KINDS
                },
            }
        out[s] = entry
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"`{result['command']}`; JSON: `benchmarks/results/{RESULT}`. Preset {result['preset']}, "
        f"6 honest workers (2 replicas a block), lockstep, {result['rounds']} rounds of H = "
        f"{result['local_steps']}, seed {result['seed']}, every honest update accepted; each "
        "update read on the probe's 32-window slice of its version at step S (t: its relative change "
        "over its paired standard error; forged: bench/adversarial.py's kinds at the norm bound, "
        "from round 1). Late: the second half of the rounds.",
        "",
        "| S | rounds | honest max t | honest median t | honest t < 0 | t < 1 | t < 2 | "
        + " | ".join(f"{k} min t" for k in KINDS)
        + " |",
        "|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(KINDS),
    ]
    for s, parts in result["summary"].items():
        for part, e in parts.items():
            forged = " | ".join(
                "—" if e[f"{k}_min_t"] is None else f"{e[f'{k}_min_t']:+.1f}" for k in KINDS
            )
            lines.append(
                f"| {s} | {part} | {e['honest_max_t']:+.1f} | {e['honest_median_t']:+.1f} | "
                f"{e['honest_below_0']:.2f} | {e['honest_below_1']:.2f} | {e['honest_below_2']:.2f} "
                f"| {forged} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="(default: tiny)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--steps", default="1,0.5,0.25,0.1", help="probe steps to read at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    steps = [float(s) for s in args.steps.split(",")]
    cfg = apply_overrides(
        preset(args.preset), [f"steps={args.rounds * args.local_steps}", f"seed={args.seed}"]
    )
    bound = delta_norm_bound(cfg, args.local_steps, largest_block(initial_blocks(cfg)))
    recorder = Recorder(steps, bound, replicas=2)
    recorder.install()
    protocol = {"local_steps": args.local_steps, "probe_step": 1.0, "probe_z": 10.0}
    spec = SimSpec(cfg, workers=6, rounds=args.rounds, protocol=protocol, eval_every=args.rounds)
    started = time.perf_counter()
    train, valid = load_split(args.data, "train"), load_split(args.data, "valid")
    report, _ = simulate(spec, [load_regime("lockstep")], train, valid)
    rows = recorder.honest + recorder.forged
    command = "python bench/probe_effects.py " + " ".join(sys.argv[1:])
    result = {
        "command": command.strip(),
        "machine": machine(),
        "preset": args.preset,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "seed": args.seed,
        "steps": steps,
        "final_sampler_ce": report["regimes"]["lockstep"]["final_sampler_ce"],
        "updates": report["regimes"]["lockstep"]["updates"],
        "summary": summary(rows, steps),
        "honest": recorder.honest,
        "forged": recorder.forged,
        "wall_s": time.perf_counter() - started,
    }
    write_json(RESULT, result)
    update_section("probe-effects", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
