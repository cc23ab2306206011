"""gen_ce over generation seeds: is a gap between two span_frontier rows more than seed noise?

Takes the small frontier's trained models (benchmarks/work/span_frontier, made by
bench/span_frontier.py --preset small ... --drafter-steps 8000) and scores the plain K = 1 row
and the lm-drafted speculative row (D = 16, M = 4) at each of --seeds, on the frontier's judge and
prompts. Writes benchmarks/results/gen_seeds.json.

    python bench/gen_seeds.py --seeds 0,1,2        # ~7 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from blocktrain.data import load_split
from blocktrain.model.speculative import ModelDrafter
from blocktrain.training import load_model
from blocktrain.training.generated import GenSettings, evaluate_generation
from report import ROOT, machine, write_json  # bench/report.py

WORK = ROOT / "benchmarks" / "work" / "span_frontier"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--judge", default="judge-3000", help="the judge's run under the work dir")
    p.add_argument("--drafter", default="drafter-T128-8000", help="the lm drafter's run")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    judge, k1, lm = (load_model(WORK / run)[1] for run in (args.judge, "small/k1", args.drafter))
    first = GenSettings()
    width = first.prompt_bytes + first.continuation_bytes
    prompts = load_split(None, "test").windows(width, width * first.prompts)
    rows = {
        "blocktrain-euler": lambda seed: (GenSettings(sampler="euler", seed=seed), None),
        "blocktrain-spec-lm-euler D=16 M=4": lambda seed: (
            GenSettings(sampler="euler", draft_bytes=16, verify_draws=4, seed=seed),
            ModelDrafter(lm),
        ),
    }
    out = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, make in rows.items():
            gen, drafter = make(seed)
            r = evaluate_generation(k1, judge, prompts, gen, drafter)
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
        "gen_seeds.json",
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
