"""BlockTrain against the end-to-end reference at equal steps, for one preset: each
trained for the preset's steps (per block for BlockTrain), then both evaluated on the same
held-out bytes with `blocktrain eval --against`.

Runs live in benchmarks/work/pair-PRESET-{bt,ref}; a finished run is reused, an interrupted one
resumed. Writes benchmarks/results/pair_PRESET.json and the `pair-PRESET` section of
docs/research/quality.md.

    OMP_NUM_THREADS=1 python bench/quality_pair.py --preset small     # about an hour per model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from report import RESEARCH, ROOT, blocktrain, machine, trained, update_section, write_json

SECTION_MD = RESEARCH / "quality.md"  # superseded by the full-mode run of BENCHMARKS.md


def trained_preset(run: Path, preset: str, reference: bool) -> None:
    """Train `run` to the preset's steps, resuming it or leaving it as it is when finished."""
    argv = ["--preset", preset, *(["--reference"] if reference else [])]
    trained(run, argv)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="small")
    p.add_argument("--sweeps", type=int, default=64, help="M for the sampler CE")
    p.add_argument("--bytes", type=int, default=32768, help="test bytes")
    args = p.parse_args()
    work = ROOT / "benchmarks" / "work"
    bt, ref = work / f"pair-{args.preset}-bt", work / f"pair-{args.preset}-ref"
    trained_preset(bt, args.preset, reference=False)
    trained_preset(ref, args.preset, reference=True)
    argv = ["eval", str(bt), "--against", str(ref), "--split", "test", "--json"]
    argv += ["--sweeps", str(args.sweeps), "--bytes", str(args.bytes)]
    ev = json.loads(blocktrain(argv))
    steps = {
        name: json.loads((run / "state.json").read_text())
        for name, run in (("blocktrain", bt), ("reference", ref))
    }
    command = ("OMP_NUM_THREADS=1 python bench/quality_pair.py " + " ".join(sys.argv[1:])).strip()
    result = {"command": command, "machine": machine(), "runs": steps, "eval": ev}
    write_json(f"pair_{args.preset}.json", result)
    update_section(f"pair-{args.preset}", markdown(args.preset, result), SECTION_MD)
    print(markdown(args.preset, result))


def markdown(preset: str, result: dict[str, Any]) -> str:
    ev, runs = result["eval"], result["runs"]
    by_m = ev["sampler_ce_by_sweeps"]
    rows = [
        f"`{result['command']}`: both at the preset's steps ({runs['blocktrain']['step']} per "
        f"block; reference {runs['reference']['step']}), not converged; the same "
        f"{ev['bytes']} test bytes.",
        "",
        "| model | CE (nats/byte) |",
        "|---|---:|",
        f"| reference | **{ev['reference']['ce']:.3f}** |",
        f"| BlockTrain sampler CE, M = {ev['sweeps']} | **{ev['sampler_ce']:.3f}** |",
        *(f"| BlockTrain sampler CE, M = {m} | {v:.3f} |" for m, v in reversed(by_m.items())),
        f"| from-noise CE | {ev['from_noise_ce']:.3f} |",
        "| mixture after each block | "
        + " / ".join(f"{v:.3f}" for v in ev["sampler_ce_per_step"])
        + " |",
        "",
        f"Gap (sampler CE − reference): {ev['sampler_ce'] - ev['reference']['ce']:+.3f}.",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
