"""Bytes per verify traversal of speculative K = 1 generation, over many prompts.

The span frontier times one short request per row, so its bytes-per-traversal column carries the
luck of a few dozen acceptance draws. This script measures the acceptance side alone, in process
(model.speculative.generate_speculative, the router's loop), over --prompts test prompts: for
each drafter, sampler and number of noise draws M (antithetic: independent draws left with
their code, bb9b624 measures them), the bytes a traversal yields (mean over prompts, and its standard error). Under
the ancestral sampler the M draws fork at the last grid point.

Takes the small frontier's trained models (benchmarks/work/span_frontier, made by
bench/span_frontier.py --preset small ...): the K = 1 verifier and the lm drafters named by
--drafters (run folders there: the one trained on text, and the one distilled towards the
verifier by `blocktrain distill`). Writes benchmarks/results/verify_acceptance.json and the
`verify-acceptance` section of BENCHMARKS.md.

    python bench/verify_acceptance.py                 # ~8 min on 2 cores
    python bench/verify_acceptance.py --prompts 4 --configs euler:4     # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from blocktrain.data import load_split
from blocktrain.model import BlockStack, Sampling, SigmaSchedule, stack_denoiser
from blocktrain.model.reference import Reference
from blocktrain.model.speculative import ModelDrafter, generate_speculative, verify_fork
from blocktrain.training import load_model
from report import ROOT, machine, update_section, write_json  # bench/report.py

WORK = ROOT / "benchmarks" / "work" / "span_frontier"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=16, help="test prompts of 128 bytes")
    p.add_argument("--bytes", type=int, default=128, help="bytes generated per prompt")
    p.add_argument("--draft-bytes", type=int, default=16)
    p.add_argument(
        "--configs",
        default="euler:1,euler:4,ancestral:4,ancestral:16",
        help="SAMPLER:M per row",
    )
    p.add_argument(
        "--drafters",
        default="drafter-T128-8000,drafter-T128-8000-kd800-k1",
        help="the lm drafters' runs in benchmarks/work/span_frontier",
    )
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    _, k1 = load_model(WORK / "small" / "k1")
    assert isinstance(k1, BlockStack)
    prompts = load_split(None, "test").windows(256, 256 * args.prompts)[:, :128]
    grid = SigmaSchedule.from_config(k1.cfg).sampler_grid(1)
    configs = []
    for text in args.configs.split(","):
        sampler, m = text.split(":")
        configs.append((sampler, int(m)))
    rows: list[dict[str, Any]] = []
    for name in args.drafters.split(","):
        _, lm = load_model(WORK / name)
        assert isinstance(lm, Reference)
        drafter = ModelDrafter(lm)
        for sampler, m in configs:
            t0 = time.perf_counter()
            per_prompt = []
            for i in range(prompts.shape[0]):
                _, loop = generate_speculative(
                    stack_denoiser(k1),
                    prompts[i : i + 1],
                    args.bytes,
                    drafter=drafter,
                    draft_len=args.draft_bytes,
                    grid=grid,
                    targets=k1.targets,
                    seq_len=k1.cfg.seq_len,
                    sampling=Sampling(),
                    generator=torch.Generator().manual_seed(i),
                    method=sampler,
                    draws=m,
                )
                per_prompt.append(loop.produced / loop.traversals)
            rows.append(
                {
                    "drafter": name,
                    "sampler": sampler,
                    "verify_draws": m,
                    "forked": verify_fork(len(grid), sampler, m) > 0,
                    "antithetic": m > 1,
                    "bytes_per_traversal": statistics.mean(per_prompt),
                    "sem": statistics.stdev(per_prompt) / len(per_prompt) ** 0.5,
                    "per_prompt": per_prompt,
                }
            )
            print(
                f"{name} {sampler} M = {m}: "
                f"{rows[-1]['bytes_per_traversal']:.2f} ± {rows[-1]['sem']:.2f} "
                f"bytes/traversal [{time.perf_counter() - t0:.0f} s]",
                file=sys.stderr,
                flush=True,
            )
    doc = {
        "command_args": "".join(f" {a}" for a in sys.argv[1:]),
        "prompts": args.prompts,
        "bytes": args.bytes,
        "draft_bytes": args.draft_bytes,
        "machine": machine(),
        "rows": rows,
    }
    write_json("verify_acceptance.json", doc)
    report(doc)


def report(doc: dict[str, Any]) -> None:
    lines = [
        "## Speculative K = 1: bytes per verify traversal",
        "",
        f"`python bench/verify_acceptance.py{doc['command_args']}`; JSON: "
        "`benchmarks/results/verify_acceptance.json`. The small frontier's K = 1 model verifies "
        f"D = {doc['draft_bytes']} bytes drafted by a 1-layer lm drafter, in process, "
        f"{doc['bytes']} bytes after each of {doc['prompts']} test prompts (seed = the prompt's "
        "index); mean over prompts ± s.e. Drafters: `drafter-T128-8000` is trained 8,000 steps "
        "on the text; `-kd800-k1` is it after 800 more steps of `blocktrain distill` towards the "
        "K = 1 Euler sampler's law. Forked: the ancestral sampler's M draws share the sweep up "
        "to its last grid point. Antithetic: the M draws' noises in pairs (eps, -eps), and a "
        "fork's bytes stratified (model.sampler.fork_step); else independent.",
        "",
        "| drafter | sampler | M | forked | draws | bytes per traversal |",
        "|---|---|---:|---|---|---:|",
    ]
    for r in doc["rows"]:
        draws = (
            "antithetic"
            if r.get("antithetic")
            else "independent"
            if r["verify_draws"] > 1
            else "one"
        )
        lines.append(
            f"| {r.get('drafter', '')} | {r['sampler']} | {r['verify_draws']} | "
            f"{'yes' if r['forked'] else 'no'} | {draws} | "
            f"{r['bytes_per_traversal']:.2f} ± {r['sem']:.2f} |"
        )
    update_section("verify-acceptance", "\n".join(lines))


if __name__ == "__main__":
    main()
