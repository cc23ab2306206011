"""How far apart honest updates lie for the replay screen, and how far their gain stands above
chance for the effect probe's gain test, against near-copies and noise (issue 58): the
evidence behind `copy_distance` and `probe_gain_z` (docs/protocol.md, Replays, Effect probe).

One simulator run (6 honest workers, 2 replicas a block, lockstep, real local training, the
aggregator's defaults). Every honest update the probe reads is recorded: its paired t (relative
change over its standard error), its gain_z (first-order gain over its chance deviation) and
its sketch. From each, the two near-copies of issue 58 are made and sketched (one fp16 value
moved by one ulp; Gaussian noise of 1e-3 of its norm). Once per block and round, zero-mean
Gaussian noise at 0.1, 0.5 and 1 x the norm bound (just inside it), --seeds directions each,
is read on the same slice, and judged by the rule in force and by the rule before the gain test
(accepted when the loss falls or rises by less than probe_z standard errors).

Distances are between unit sketches (`replays.Sketcher`: the distance between two deltas'
directions, 0 to 2): between two identities' updates of one round, and between one identity's
updates within replay_rounds rounds.

Writes benchmarks/results/honest_spread.json (honest_spread-small.json with --preset small) and
the "honest-spread" section of BENCHMARKS.md.

    python bench/honest_spread.py                          # tiny, 10 rounds: ~3 min, 1 thread
    python bench/honest_spread.py --preset small --rounds 2   # the first rounds, where
                                                           # replicas lie closest
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Hashable
from typing import Any

import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.presets import PRESETS, preset
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.protocol.core.effect import judge_effect
from blocktrain.protocol.core.events import Checked
from blocktrain.protocol.core.replays import distance
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.simulate import SimSpec, simulate
from blocktrain.simulate.attacks.forge import AT_BOUND
from blocktrain.simulate.regimes import load_regime
from blocktrain.training.local import initial_blocks
from report import machine, update_section, write_json

SHARES = (0.1, 0.5, 1.0)
Tensors = dict[str, torch.Tensor]


def one_ulp(delta: Tensors) -> Tensors:
    """The delta in fp16 (the wire's) with its first value moved by one ulp."""
    out = {k: v.half().clone() for k, v in delta.items()}
    out[sorted(out)[0]].view(-1).view(torch.int16)[0] += 1
    return out


def gaussian(like: Tensors, norm: float, seed: int) -> Tensors:
    gen = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(v.shape, generator=gen) for k, v in like.items()}
    scale = norm / math.sqrt(sum(float(t.square().sum()) for t in out.values()))
    return {k: scale * t for k, t in out.items()}


def size(delta: Tensors) -> float:
    return math.sqrt(sum(float(t.float().square().sum()) for t in delta.values()))


class Recorder:
    """Wraps `RoundEngine.finish`: each honest update's reading and sketch, its near-copies'
    distances, and once per block and round the noise readings."""

    def __init__(self, seeds: int) -> None:
        self.seeds = seeds
        self.original = RoundEngine.finish
        self.honest: list[dict[str, Any]] = []
        self.noise: list[dict[str, Any]] = []
        self.sketches: list[tuple[int, int, Hashable, torch.Tensor]] = []
        self._noised: set[tuple[int, int]] = set()

    def install(self) -> None:
        recorder = self

        def finish(engine: RoundEngine, checked: Checked, worker: int | None = None) -> Checked:
            out = recorder.original(engine, checked, worker)
            recorder.saw(engine, out, worker)
            return out

        RoundEngine.finish = finish  # type: ignore[method-assign]

    def saw(self, engine: RoundEngine, out: Checked, worker: int | None) -> None:
        c, effect, meta = out.candidate, out.effect, out.meta
        if c is None or effect is None or meta is None or c.sketch is None or worker is None:
            return
        identity = engine.registry.identity(worker)
        sketcher, block, rnd = engine.sketcher, c.block, meta.round
        near = {
            "one_ulp": sketcher.sketch(one_ulp(c.tensors)),
            "noise_1e-3": sketcher.sketch(
                {
                    k: v.float() + n
                    for (k, v), n in zip(
                        c.tensors.items(),
                        gaussian(c.tensors, 1e-3 * size(c.tensors), len(self.honest)).values(),
                        strict=True,
                    )
                }
            ),
        }
        self.honest.append(
            {
                "block": block,
                "round": rnd,
                "worker": worker,
                "t": effect.relative / effect.stderr if effect.stderr > 0 else 0.0,
                "gain_z": effect.gain_z,
                "verdict": out.verdict.reason or "accepted",
                **{
                    f"{k}_distance": float(distance(c.sketch.unsqueeze(0), s)[0])
                    for k, s in near.items()
                    if s is not None
                },
            }
        )
        self.sketches.append((block, rnd, identity, c.sketch))
        if (block, rnd) not in self._noised:
            self._noised.add((block, rnd))
            self.read_noise(engine, block, rnd)

    def read_noise(self, engine: RoundEngine, block: int, rnd: int) -> None:
        assert engine.probe is not None
        s = engine.settings
        weights = engine.blocks[block].weights
        others = {b: st.weights for b, st in engine.blocks.items() if b != block}
        for share in SHARES:
            for seed in range(self.seeds):
                noise = gaussian(
                    weights, share * AT_BOUND * s.max_delta_norm, 1000 * rnd + 10 * block + seed
                )
                e = engine.probe.effect(block, weights, noise, others, s.probe_step)
                band = engine.bands.get(block)
                now = judge_effect(e, s.probe_tolerance, band, s.probe_z, s.probe_gain_z)
                before = judge_effect(e, s.probe_tolerance, band, s.probe_z, -math.inf)
                self.noise.append(
                    {
                        "block": block,
                        "round": rnd,
                        "share": share,
                        "t": e.relative / e.stderr if e.stderr > 0 else 0.0,
                        "gain_z": e.gain_z,
                        "verdict": now.reason or "accepted",
                        "verdict_without_gain_test": before.reason or "accepted",
                    }
                )

    def distances(self, window: int) -> dict[str, Any]:
        """The least distance between two identities' updates of one block and round, and
        between one identity's updates of one block within `window` rounds; and the first
        round of each pair."""
        other: list[tuple[float, int]] = []
        own: list[tuple[float, int]] = []
        for i, (b1, r1, id1, s1) in enumerate(self.sketches):
            for b2, r2, id2, s2 in self.sketches[i + 1 :]:
                if b1 != b2:
                    continue
                d = float(distance(s1.unsqueeze(0), s2)[0])
                if id1 != id2 and r1 == r2:
                    other.append((d, r1))
                elif id1 == id2 and 0 < abs(r1 - r2) <= window:
                    own.append((d, min(r1, r2)))
        return {
            "other_identity_same_round": summary_of(other),
            "same_identity_within_window": summary_of(own),
        }


def summary_of(pairs: list[tuple[float, int]]) -> dict[str, Any]:
    if not pairs:
        return {"pairs": 0}
    least = min(pairs)
    return {
        "pairs": len(pairs),
        "min": least[0],
        "min_round": least[1],
        "median": statistics.median(d for d, _ in pairs),
    }


def noise_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for share in SHARES:
        mine = [r for r in rows if r["share"] == share]
        out[f"{share:g}"] = {
            "n": len(mine),
            "min_t": min(r["t"] for r in mine),
            "max_gain_z": max(r["gain_z"] for r in mine),
            "accepted": sum(r["verdict"] == "accepted" for r in mine),
            "accepted_without_gain_test": sum(
                r["verdict_without_gain_test"] == "accepted" for r in mine
            ),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    s, h, d = result["settings"], result["honest"], result["distances"]
    lines = [
        f"`{result['command']}`; JSON: `benchmarks/results/{result['json']}`. Preset "
        f"{result['preset']}, 6 honest workers (2 replicas a block), lockstep, "
        f"{result['rounds']} rounds of H = {result['local_steps']}, seed {result['seed']}, the "
        f"defaults (copy_distance {s['copy_distance']:g}, probe_gain_z {s['probe_gain_z']:g}, "
        f"probe_z {s['probe_z']:g}); norm bound {s['max_delta_norm']:.3g}; {result['wall_s']:.0f} s.",
        "",
        "| honest updates read | accepted | refused | gain_z min / median | paired t max | "
        "one-ulp copy distance max | 1e-3 noise copy distance max |",
        "|---:|---:|---|---:|---:|---:|---:|",
        f"| {h['n']} | {h['accepted']} | {h['refused'] or 'none'} | {h['min_gain_z']:.1f} / "
        f"{h['median_gain_z']:.1f} | {h['max_t']:+.2f} | {h['max_one_ulp_distance']:.2g} | "
        f"{h['max_noise_1e-3_distance']:.2g} |",
        "",
        "| honest pairs (sketch distance) | pairs | min | first round of the min | median |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, e in d.items():
        if e["pairs"]:
            lines.append(
                f"| {name.replace('_', ' ')} | {e['pairs']} | {e['min']:.3f} | {e['min_round']} "
                f"| {e['median']:.3f} |"
            )
    lines += [
        "",
        "| noise, share of the bound | read | paired t min | gain_z max | accepted | accepted "
        "without the gain test |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for share, e in result["noise_summary"].items():
        lines.append(
            f"| {share} | {e['n']} | {e['min_t']:+.1f} | {e['max_gain_z']:+.2f} | "
            f"{e['accepted']} | {e['accepted_without_gain_test']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="(default: tiny)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--seeds", type=int, default=2, help="noise directions per share and round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = apply_overrides(
        preset(args.preset), [f"steps={args.rounds * args.local_steps}", f"seed={args.seed}"]
    )
    recorder = Recorder(args.seeds)
    recorder.install()
    t = cfg.model.seq_len  # the run's CE is not what this bench reads: evaluate the least
    spec = SimSpec(
        cfg, workers=6, rounds=args.rounds, protocol={"local_steps": args.local_steps},
        eval_every=args.rounds, eval_bytes=t, final_sweeps=1, final_bytes=t,
    )  # fmt: skip
    started = time.perf_counter()
    train, valid = load_split(args.data, "train"), load_split(args.data, "valid")
    report, _ = simulate(spec, [load_regime("lockstep")], train, valid)
    regime = report["regimes"]["lockstep"]
    refused: dict[str, int] = {}
    for w in regime["workers"]:
        for reason, n in w["refused"].items():
            refused[reason] = refused.get(reason, 0) + n
    h = recorder.honest
    resolved = derived_settings(
        cfg, {"local_steps": args.local_steps}, largest_block(initial_blocks(cfg))
    )
    settings = {
        "copy_distance": resolved.copy_distance,
        "probe_gain_z": resolved.probe_gain_z,
        "probe_z": resolved.probe_z,
        "probe_step": resolved.probe_step,
        "replay_rounds": resolved.replay_rounds,
        "max_delta_norm": resolved.max_delta_norm,
    }
    shape = "" if args.preset == "tiny" else f"-{args.preset}"
    name = f"honest_spread{shape}.json"
    result = {
        "command": ("python bench/honest_spread.py " + " ".join(sys.argv[1:])).strip(),
        "json": name,
        "machine": machine(),
        "preset": args.preset,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "seed": args.seed,
        "settings": settings,
        "honest": {
            "n": len(h),
            "accepted": sum(r["verdict"] == "accepted" for r in h),
            "refused": refused,
            "min_gain_z": min(r["gain_z"] for r in h),
            "median_gain_z": statistics.median(r["gain_z"] for r in h),
            "max_t": max(r["t"] for r in h),
            "max_one_ulp_distance": max(r["one_ulp_distance"] for r in h),
            "max_noise_1e-3_distance": max(r["noise_1e-3_distance"] for r in h),
        },
        "distances": recorder.distances(settings["replay_rounds"]),
        "noise_summary": noise_summary(recorder.noise),
        "updates": h,
        "noise": recorder.noise,
        "wall_s": time.perf_counter() - started,
    }
    write_json(name, result)
    update_section(f"honest-spread{shape}", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
