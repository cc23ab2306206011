"""gen_ce over generation seeds: is a gap between span_frontier rows more than seed noise?

Takes the small frontier's trained models (benchmarks/work/span_frontier, made by
bench/span_frontier.py --preset small ... --drafter-steps 8000) and scores each of --rows at each
of --seeds, on the frontier's judge and prompts. Rows: ar (the AR pipeline's model), bt-euler and
bt-ancestral (plain K = 1), spec-lm-euler-m4 and spec-lm-ancestral-m16 (lm-drafted speculative,
D = 16, M = 4 or 16 draws). Writes benchmarks/results/NAME.json.

    python bench/gen_seeds.py --seeds 0,1,2        # ~7 min on 2 cores: bt-euler, spec-lm-euler-m4
    python bench/gen_seeds.py --rows ar,bt-euler,bt-ancestral,spec-lm-ancestral-m16 \
        --name gen_seeds_ancestral
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from blocktrain.data import load_split
from blocktrain.model.speculative import ModelDrafter
from blocktrain.training import load_model
from blocktrain.training.generated import GenSettings, evaluate_generation
from report import ROOT, machine, write_json  # bench/report.py

WORK = ROOT / "benchmarks" / "work" / "span_frontier"
# Row key -> (the row's name in the JSON, the run under WORK/small, its GenSettings fields).
ROWS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "ar": ("ar", "ref", {}),
    "bt-euler": ("blocktrain-euler", "k1", {"sampler": "euler"}),
    "bt-ancestral": ("blocktrain-ancestral", "k1", {"sampler": "ancestral"}),
    "spec-lm-euler-m4": (
        "blocktrain-spec-lm-euler D=16 M=4",
        "k1",
        {"sampler": "euler", "draft_bytes": 16, "verify_draws": 4},
    ),
    "spec-lm-ancestral-m16": (
        "blocktrain-spec-lm-ancestral D=16 M=16",
        "k1",
        {"sampler": "ancestral", "draft_bytes": 16, "verify_draws": 16},
    ),
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--judge", default="judge-3000", help="the judge's run under the work dir")
    p.add_argument("--drafter", default="drafter-T128-8000", help="the lm drafter's run")
    p.add_argument("--rows", default="bt-euler,spec-lm-euler-m4", help=", ".join(ROWS))
    p.add_argument("--name", default="gen_seeds", help="the JSON it writes (NAME.json)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        p.error(f"unknown row(s) {sorted(unknown)}; choose from {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)
    judge, lm = (load_model(WORK / run)[1] for run in (args.judge, args.drafter))
    models = {run: load_model(WORK / "small" / run)[1] for run in ("ref", "k1")}
    first = GenSettings()
    width = first.prompt_bytes + first.continuation_bytes
    prompts = load_split(None, "test").windows(width, width * first.prompts)
    rows = {ROWS[key][0]: ROWS[key] for key in args.rows.split(",")}
    out = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, (_, run, fields) in rows.items():
            gen = GenSettings(seed=seed, **fields)
            drafter = ModelDrafter(lm) if gen.draft_bytes else None
            r = evaluate_generation(models[run], judge, prompts, gen, drafter)
            out.append({"row": name, "seed": seed, "gen_ce": r["gen_ce"], "sem": r["gen_ce_sem"]})
            print(out[-1], file=sys.stderr, flush=True)
    summary = {
        name: {
            "mean": statistics.mean(v := [r["gen_ce"] for r in out if r["row"] == name]),
            "stdev": statistics.stdev(v) if len(v) > 1 else 0.0,
        }
        for name in rows
    }
    print(summary, file=sys.stderr)
    write_json(
        f"{args.name}.json",
        {
            "judge": args.judge,
            "drafter": args.drafter,
            "machine": machine(),
            "rows": out,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
