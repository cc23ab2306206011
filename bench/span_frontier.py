"""Span generation: speed and quality side by side, on trained weights.

For one preset it trains (resumably, in benchmarks/work/span_frontier/PRESET/) the fixed judge
(preset `judge`, an autoregressive byte model with its own seed), the end-to-end reference (the
autoregressive pipeline's model) and one BlockTrain model per span K at today's defaults. Then
every row is measured on the same test text:

- quality: gen_ce (the judge's CE on continuations of fixed test prompts at temperature 1),
  floor_ce (the judge on the real continuations), the outputs' byte entropy, and joint_ce (the
  sampler's joint CE per byte of whole spans, M sweeps; for the AR pipeline its exact CE);
- speed: three `serve-block` host processes and a `serve` router on loopback, hop latency
  emulated in the transport, bytes/s of one request of --speed-bytes bytes at each hop setting,
  and the ratio to the plain AR pipeline at the same hop, measured in the same chain.

Speculative rows (--drafts D): the K = 1 model and the AR pipeline verify D bytes drafted on the
router by each of --drafters: `ngram` (the byte n-gram), `lm` (a 1-layer autoregressive byte
model of the tiny width, trained here --drafter-steps steps on the text) and `lm-kd` (that model
after --drafter-distill steps of `blocktrain distill` towards the row's verifier: the K = 1
model's Euler sampler for the BlockTrain rows, the AR model for the AR rows, so that both get
the same help); BlockTrain verify sweeps carry each of --verify-draws noise draws, antithetic,
under each of --samplers (the ancestral sampler's draws fork at the last grid point:
model.speculative.verify_fork). Each drafter's rows are timed through a chain of their own.

Writes benchmarks/results/span_frontier.json ({"rows": [...]}, one row per method, K, S and hop)
and the `span-frontier` section of BENCHMARKS.md.

    python bench/span_frontier.py --preset tiny                 # ~40 min on 2 cores, judge included
    python bench/span_frontier.py --preset tiny --report        # rebuild the section from the JSON
    python bench/span_frontier.py --recipes lowsigma --spans 4,16 --steps 1200 --quality-only
    python bench/span_frontier.py --preset small --judge-steps 3000 --spans 1,4,16,64 \
        --recipes default --samplers euler,ancestral \
        --span-samplers euler --drafts 16 --drafters ngram,lm-kd \
        --verify-draws 1,4,16 --drafter-steps 8000 --drafter-distill 800 --speed-bytes 128

--steps N trains every compared model (not the judge) N steps, in benchmarks/work/span_frontier/
PRESET-N/. --quality-only skips the speed phase and writes span_frontier_quality.json and the
`span-frontier-quality` section (--name) instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from typing import Any

import httpx
import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split, resolve_data_path
from blocktrain.data.ngram import NgramDrafter
from blocktrain.model import BlockStack, Reference
from blocktrain.model.speculative import Drafter, ModelDrafter
from blocktrain.presets import preset
from blocktrain.training import EvalSettings, evaluate_blocktrain, evaluate_reference, load_model
from blocktrain.training.generated import GenSettings, evaluate_generation
from report import ROOT, machine, trained, write_json  # bench/report.py
from serving import chain, measure  # bench/serving.py
from span_report import QUALITY_KEYS, report, report_quality  # bench/span_report.py

WORK = ROOT / "benchmarks" / "work" / "span_frontier"
# Training recipes for the span models, as `--set` overrides of the preset (K > 1 only).
# default: today's defaults (sigma in [1, 10]). lowsigma: span-research.md R3's first test, a
# trajectory that crosses the window where the noisy state decides a byte (sigma ~ 0.7 to 0.15),
# so that more steps per block can couple the bytes of a span.
# The masked recipes (process = masked) left the product with their code (docs/decisions.md);
# bb9b624 runs them.
RECIPES: dict[str, list[str]] = {
    "default": [],
    "lowsigma": ["sigma_min=0.1"],
}


def drafter_of(row: dict[str, Any]) -> str | None:
    """The drafter a row drafts with: its kind, and for `lm-kd` the run it was distilled
    towards (each verifier gets its own: the AR pipeline's is distilled towards the AR model)."""
    kind = row.get("drafter")
    return f"lm-kd:{row['run']}" if kind == "lm-kd" else kind


def router_of(row: dict[str, Any]) -> str | None:
    """The drafter of the router that measures a row's speed: None, the default router, which
    drafts with the n-gram when the run has one."""
    drafter = drafter_of(row)
    return None if drafter == "ngram" else drafter


def quality(
    model: BlockStack | Reference,
    judge: Reference,
    prompts: torch.Tensor,
    windows: torch.Tensor,
    gen: GenSettings,
    sweeps: int,
    drafter: Drafter | None,
    joints: dict[tuple[int, int, str | None], float],
) -> dict[str, Any]:
    """The judged continuations and the joint CE on the test windows. The joint CE depends on
    the model and its sweep only, so `joints` keeps it by (model, S, sampler): a speculative row
    reuses its verifier's (drafting does not change the law of the text)."""
    t0 = time.perf_counter()
    judged = evaluate_generation(model, judge, prompts, gen, drafter)
    key = (id(model), gen.steps_per_block, gen.sampler)
    if key in joints:
        joint = joints[key]
    elif isinstance(model, Reference):
        joint = evaluate_reference(model, windows, EvalSettings())["ce"]  # exact, chain rule
    else:
        settings = EvalSettings(
            sweeps=sweeps,
            steps_per_block=gen.steps_per_block,
            sampler=gen.sampler,
            oracle=False,
        )
        joint = evaluate_blocktrain(model, windows, settings)["joint_ce"]
    joints[key] = joint
    print(
        f"  gen_ce {judged['gen_ce']:.3f} (floor {judged['floor_ce']:.3f}) entropy "
        f"{judged['entropy']:.3f} joint_ce {joint:.3f}  [{time.perf_counter() - t0:.0f} s]",
        file=sys.stderr,
        flush=True,
    )
    return {**judged, "joint_ce": joint}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", help="the shape of the compared models")
    p.add_argument("--spans", default="1,4,16", help="span K of the BlockTrain models")
    p.add_argument(
        "--recipe-spans",
        default="",
        help="span K of the recipes other than default, where they differ from --spans (e.g. "
        "--spans 1 --recipe-spans 4: the K = 1 model and the recipes' K = 4 ones)",
    )
    p.add_argument("--steps-per-block", default="1,4,16", help="S values for K > 1")
    p.add_argument("--samplers", default="euler,ancestral", help="sampler steps compared")
    p.add_argument(
        "--span-samplers",
        help="samplers of the default recipe's K > 1 rows (default: --samplers); the K = 1 and "
        "speculative rows run --samplers",
    )
    p.add_argument("--recipes", default="default,lowsigma", help=f"of {', '.join(RECIPES)}")
    p.add_argument("--judge-steps", type=int, default=3000, help="training steps of the judge")
    p.add_argument("--hops", default="0,10,50", help="emulated one-way ms per hop")
    p.add_argument("--drafts", default="4,8", help="draft_bytes of the speculative K = 1 rows")
    p.add_argument("--draft-order", type=int, default=3, help="context bytes of the n-gram drafter")
    p.add_argument(
        "--drafters",
        default="ngram,lm",
        help="drafters of the speculative rows: ngram (the router's byte n-gram), lm (a small "
        "autoregressive model on the router, trained here) and lm-kd (lm distilled towards each "
        "verifier)",
    )
    p.add_argument(
        "--drafter-steps", type=int, default=1200, help="training steps of the lm drafter"
    )
    p.add_argument(
        "--drafter-distill",
        type=int,
        default=800,
        help="steps of `blocktrain distill` that turn the lm drafter into the lm-kd ones",
    )
    p.add_argument("--verify-draws", default="1,4", help="rows M of the BlockTrain verify sweeps")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--sweeps", type=int, default=16, help="M for joint_ce")
    p.add_argument("--joint-bytes", type=int, default=16384, help="test bytes for joint_ce")
    p.add_argument("--speed-bytes", type=int, default=64, help="bytes per timed request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads per host process")
    p.add_argument(
        "--skip",
        default="",
        help="rows left out, as METHOD:K:S,... (e.g. blocktrain-euler:64:16: a row too costly "
        "for the run's time), named in the command the report quotes",
    )
    p.add_argument("--steps", type=int, default=0, help="training steps (0: the preset's)")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="settings for every compared model (not the judge), e.g. layers=1 blocks=1; "
        "the work dir gets --tag",
    )
    p.add_argument("--tag", default="", help="suffix of the work dir (needed with --set)")
    p.add_argument("--quality-only", action="store_true", help="skip the speed phase")
    p.add_argument(
        "--name",
        help="the JSON (NAME.json) and BENCHMARKS.md section it writes (default: span_frontier, "
        "or span_frontier_quality with --quality-only)",
    )
    p.add_argument("--report", action="store_true", help="only rebuild BENCHMARKS.md")
    args = p.parse_args()
    args.name = args.name or ("span_frontier_quality" if args.quality_only else "span_frontier")
    if args.report:
        doc = json.loads((ROOT / "benchmarks" / "results" / f"{args.name}.json").read_text())
        (report_quality if args.quality_only else report)(doc, args.name)
        return
    unknown = set(args.recipes.split(",")) - set(RECIPES)
    if unknown:
        p.error(f"unknown recipe(s) {sorted(unknown)}; choose from {', '.join(RECIPES)}")
    torch.set_num_threads(args.threads)
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    spans, steps, hops = ints(args.spans), ints(args.steps_per_block), ints(args.hops)
    recipe_spans = ints(args.recipe_spans) if args.recipe_spans else spans
    samplers = args.samplers.split(",")
    span_samplers = args.span_samplers.split(",") if args.span_samplers else samplers
    skipped = set(args.skip.split(",")) - {""}

    if args.overrides and not args.tag:
        p.error("--set changes the models: name their work dir with --tag")
    work = WORK / "-".join(
        [args.preset, *([str(args.steps)] if args.steps else []), *([args.tag] if args.tag else [])]
    )
    base = apply_overrides(preset(args.preset), args.overrides).model
    train_args = ["--preset", args.preset, *(["--steps", str(args.steps)] if args.steps else [])]
    judge_dir = trained(
        WORK / f"judge-{args.judge_steps}",
        ["--preset", "judge", "--reference", "--steps", str(args.judge_steps)],
    )
    model_sets = ["--set", *args.overrides] if args.overrides else []
    runs = {"ar": trained(work / "ref", [*train_args, "--reference", *model_sets])}
    span_runs: dict[str, tuple[int, str]] = {}  # run name -> (K, recipe)
    for recipe in args.recipes.split(","):
        for k in spans if recipe == "default" else [k for k in recipe_spans if k > 1]:
            if k >= base.seq_len:
                print(f"skipping K = {k} ({recipe}): does not fit the preset", file=sys.stderr)
                continue
            name = f"k{k}" if recipe == "default" else f"k{k}-{recipe}"
            sets = [f"span={k}", *RECIPES[recipe], *args.overrides]
            runs[name] = trained(work / name, [*train_args, "--set", *sets])
            span_runs[name] = (k, recipe)

    _, judge = load_model(judge_dir)
    assert isinstance(judge, Reference)
    test = load_split(None, "test")
    gen0 = GenSettings(prompts=args.prompts)
    width = gen0.prompt_bytes + gen0.continuation_bytes
    prompts = test.windows(width, width * args.prompts)

    rows_spec: list[dict[str, Any]] = [
        {"method": "ar", "span": 1, "steps_per_block": 0, "run": "ar", "fields": {}}
    ]
    for name, (k, recipe) in span_runs.items():
        prefix = "blocktrain" if recipe == "default" else f"blocktrain-{recipe}"
        for sampler in samplers if k == 1 else span_samplers:
            # At K = 1 more steps change nothing in [1, 10].
            for s in [1] if k == 1 else steps:
                if f"{prefix}-{sampler}:{k}:{s}" in skipped:
                    continue
                rows_spec.append(
                    {
                        "method": f"{prefix}-{sampler}",
                        "span": k,
                        "steps_per_block": s,
                        "run": name,
                        "fields": {"sampler": sampler, "steps_per_block": s},
                    }
                )
    drafts = ints(args.drafts) if args.drafts and 1 in spans else []
    drafter_kinds = args.drafters.split(",") if drafts else []
    for d in drafts:  # the same drafters for the AR pipeline, so the comparison stays fair
        for kind in drafter_kinds:
            tag = "" if kind == "ngram" else f"-{kind}"
            rows_spec.append(
                {
                    "method": f"ar-spec{tag}",
                    "span": 1,
                    "steps_per_block": 0,
                    "run": "ar",
                    "drafter": kind,
                    "fields": {"draft_bytes": d},
                }
            )
            for sampler in samplers:  # ancestral draws fork at the last grid point
                for m in ints(args.verify_draws):
                    rows_spec.append(
                        {
                            "method": f"blocktrain-spec{tag}-{sampler}",
                            "span": 1,
                            "steps_per_block": 1,
                            "run": "k1",
                            "drafter": kind,
                            "fields": {
                                "sampler": sampler,
                                "steps_per_block": 1,
                                "draft_bytes": d,
                                "verify_draws": m,
                            },
                        }
                    )
    data_path = resolve_data_path(None)
    drafters: dict[str, Drafter] = {}
    router_args: dict[str | None, tuple[str, ...]] = {None: ()}  # by router_of(row)
    if "ngram" in drafter_kinds:
        drafters["ngram"] = NgramDrafter(load_split(data_path, "train").read(), args.draft_order)
        router_args[None] = (
            "--draft-corpus",
            str(data_path),
            "--set",
            f"draft_order={args.draft_order}",
        )
    if {"lm", "lm-kd"} & set(drafter_kinds):
        # A 1-layer autoregressive byte model of the tiny width, with the compared models' T.
        lm_dir = trained(
            WORK / f"drafter-T{base.seq_len}-{args.drafter_steps}",
            [
                "--preset",
                "tiny",
                "--reference",
                "--steps",
                str(args.drafter_steps),
                "--set",
                "layers=1",
                "blocks=1",
                f"seq_len={base.seq_len}",
            ],
        )
        lm = load_model(lm_dir)[1]
        assert isinstance(lm, Reference)
        drafters["lm"] = ModelDrafter(lm)
        router_args["lm"] = ("--draft-model", str(lm_dir))
    if "lm-kd" in drafter_kinds:
        # The lm drafter distilled towards each verifier's law (blocktrain distill): the K = 1
        # model's one-sweep sampler (Euler, the default) and the AR model's softmax.
        for run in ("k1", "ar"):
            kd_dir = trained(
                lm_dir.with_name(f"{lm_dir.name}-kd{args.drafter_distill}-{run}"),
                [
                    *("--teacher", str(runs[run]), "--student", str(lm_dir)),
                    *("--steps", str(args.drafter_distill)),
                ],
                command="distill",
            )
            kd = load_model(kd_dir)[1]
            assert isinstance(kd, Reference)
            drafters[f"lm-kd:{run}"] = ModelDrafter(kd)
            router_args[f"lm-kd:{run}"] = ("--draft-model", str(kd_dir))
    unknown_drafters = {str(drafter_of(r)) for r in rows_spec if r.get("drafter")} - set(drafters)
    if unknown_drafters:
        p.error(f"unknown drafter(s) {sorted(unknown_drafters)}; choose from ngram, lm, lm-kd")

    qualities: list[dict[str, Any]] = []
    joints: dict[tuple[int, int, str | None], float] = {}
    loaded: dict[str, BlockStack | Reference] = {}
    for i, row in enumerate(rows_spec):
        print(f"[{i + 1}/{len(rows_spec)}] quality {row}", file=sys.stderr)
        # A row's quality is seeded and deterministic: kept per row, so that an interrupted
        # run, or a later speed-only pass over a --quality-only run, does not recompute it.
        same = [row, args.judge_steps, args.prompts, args.sweeps, args.joint_bytes]
        if row.get("drafter"):  # the samples depend on the drafter (the same law, other draws)
            same.append(
                {
                    "ngram": args.draft_order,
                    "lm": args.drafter_steps,
                    "lm-kd": [args.drafter_steps, args.drafter_distill],
                }[row["drafter"]]
            )
            same.append("traversals")  # results before session 12 did not count them
        if row["fields"].get("verify_draws", 1) > 1:  # and on how the draws are drawn
            same.append("antithetic")
        digest = hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]
        kept = work / "quality" / f"{row['method']}-k{row['span']}-{digest}.json"
        if kept.exists():
            qualities.append(json.loads(kept.read_text()))
            print(f"  kept: {kept.name}", file=sys.stderr)
            continue
        if row["run"] not in loaded:
            _, model = load_model(runs[row["run"]])
            assert isinstance(model, BlockStack | Reference)
            loaded[row["run"]] = model
        model = loaded[row["run"]]
        windows = test.windows(model.cfg.seq_len, args.joint_bytes)
        fields = row["fields"]
        gen = GenSettings(
            prompts=args.prompts,
            steps_per_block=fields.get("steps_per_block", 1),
            sampler=fields.get("sampler"),
            draft_bytes=fields.get("draft_bytes", 0),
            verify_draws=fields.get("verify_draws", 1),
        )
        drafter = drafters.get(drafter_of(row) or "")
        qualities.append(quality(model, judge, prompts, windows, gen, args.sweeps, drafter, joints))
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(qualities[-1]))
    if args.quality_only:
        quality_doc = {
            "preset": args.preset,
            "steps": args.steps or preset(args.preset).train.steps,
            "judge": {"run": str(judge_dir.relative_to(ROOT)), "steps": args.judge_steps},
            "prompts": args.prompts,
            "sweeps": args.sweeps,
            "joint_bytes": args.joint_bytes,
            "command_args": "".join(f" {shlex.quote(a)}" for a in sys.argv[1:]),
            "overrides": args.overrides,
            "machine": machine(),
            "rows": [
                {
                    "method": row["method"],
                    "span": row["span"],
                    "steps_per_block": row["steps_per_block"],
                    "draft_bytes": row["fields"].get("draft_bytes", 0),
                    "verify_draws": row["fields"].get("verify_draws", 0),
                    "drafter": row.get("drafter"),
                    **{key: q[key] for key in QUALITY_KEYS},
                    "sample": q["samples"][0]["generated"],
                }
                for row, q in zip(rows_spec, qualities, strict=True)
            ],
        }
        write_json(f"{args.name}.json", quality_doc)
        report_quality(quality_doc, args.name)
        return

    rows: list[dict[str, Any]] = []
    models = {name: runs[name] for name in sorted({row["run"] for row in rows_spec})}
    with httpx.Client(timeout=600) as client:
        for hop in hops:
            print(f"speed at {hop} ms per hop", file=sys.stderr, flush=True)
            # One request at a time, with the serving defaults: no batching window, so a lone
            # sweep waits for nothing (the AR stages have none either). One chain per router
            # drafter; the first (no drafter, or the n-gram) measures every row without one.
            speeds: list[dict[str, Any]] = [{}] * len(rows_spec)
            for kind in dict.fromkeys(router_of(row) for row in rows_spec):
                with chain(models, hop, args.threads, router_args[kind]) as router:
                    for i, row in enumerate(rows_spec):
                        if router_of(row) == kind:
                            speeds[i] = measure(
                                client,
                                router,
                                row["run"],
                                args.speed_bytes,
                                args.repeats,
                                row["fields"],
                            )
            ar_rate = args.speed_bytes / speeds[0]["seconds"]
            for row, q, speed in zip(rows_spec, qualities, speeds, strict=True):
                rate = args.speed_bytes / speed["seconds"]
                # The timed request's acceptance is one short draw; its time per traversal is
                # not. At the judged continuations' bytes per traversal (64 prompts), that time
                # gives the expected rate.
                seconds_per_traversal = speed["seconds"] / speed["traversals"]
                judged = q.get("bytes_per_traversal", None if row.get("drafter") else row["span"])
                expected = None if judged is None else judged / seconds_per_traversal
                rows.append(
                    {
                        "method": row["method"],
                        "span": row["span"],
                        "steps_per_block": row["steps_per_block"],
                        "draft_bytes": row["fields"].get("draft_bytes", 0),
                        "verify_draws": row["fields"].get("verify_draws", 0),
                        "drafter": row.get("drafter"),
                        "gen_ce": q["gen_ce"],
                        "gen_ce_sem": q["gen_ce_sem"],
                        "floor_ce": q["floor_ce"],
                        "entropy": q["entropy"],
                        "real_entropy": q["real_entropy"],
                        "joint_ce": q["joint_ce"],
                        "hop_ms": hop,
                        "bytes_per_s": rate,
                        "ratio_to_ar": rate / ar_rate,
                        "traversals": speed["traversals"],
                        "ms_per_traversal": 1000 * seconds_per_traversal,
                        "gen_bytes_per_traversal": judged,
                        "expected_bytes_per_s": expected,
                        "expected_ratio_to_ar": None if expected is None else expected / ar_rate,
                        "sample": q["samples"][0]["generated"],
                    }
                )
    doc = {
        "preset": args.preset,
        "steps": args.steps or preset(args.preset).train.steps,
        "command_args": "".join(f" {shlex.quote(a)}" for a in sys.argv[1:]),
        "judge": {"run": str(judge_dir.relative_to(ROOT)), "steps": args.judge_steps},
        "prompts": args.prompts,
        "prompt_bytes": gen0.prompt_bytes,
        "continuation_bytes": gen0.continuation_bytes,
        "temperature": gen0.temperature,
        "sweeps": args.sweeps,
        "joint_bytes": args.joint_bytes,
        "speed_bytes": args.speed_bytes,
        "machine": machine(),
        "rows": rows,
    }
    write_json(f"{args.name}.json", doc)
    report(doc, args.name)


if __name__ == "__main__":
    main()
