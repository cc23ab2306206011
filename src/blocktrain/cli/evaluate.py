"""`blocktrain eval`: quality of a trained run on held-out text, in nats per byte."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blocktrain.cli.common import (
    Formatter,
    add_data_arg,
    add_device_arg,
    add_named_sets,
    add_progress_arg,
    add_threads_arg,
    file_patterns,
    print_json,
    progress_bar,
    split_sets,
    use_threads,
)
from blocktrain.data import load_split
from blocktrain.data.provenance import check_data
from blocktrain.device import resolve_device
from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.model import BlockStack, Reference
from blocktrain.model.sampler import DEFAULT_SAMPLER, DEFAULT_STEPS_PER_BLOCK, SAMPLERS, sampler_for
from blocktrain.training import EvalSettings, evaluate_blocktrain, evaluate_reference, load_model
from blocktrain.training.checkpoint import RunInfo
from blocktrain.training.generated import GenSettings, evaluate_generation

EXAMPLES = """examples:
  blocktrain eval runs/tiny                          # validation split, 16 sweeps
  blocktrain eval runs/tiny --split test --json      # JSON: sampler_ce, from_noise_ce, ...
  blocktrain eval runs/tiny --against runs/ref       # the reference on the same bytes
  blocktrain eval runs/span16 --judge runs/judge     # + continuations of 64 test prompts, judged
  blocktrain eval runs/span16 --judge runs/judge --set prompts=16 temperature=0   # greedy, 16
  blocktrain eval runs/tiny --device cuda            # on the GPU (default auto: it when present)
  blocktrain eval runs/tiny --set batch_size=4       # 4 windows a forward pass (memory)
  blocktrain eval hf/tiny --data CORPUS --split test # an `export --hf` folder, as a run
"""

JUDGED_SETS = ("prompts", "prompt_bytes", "continuation_bytes", "temperature")
"""The `GenSettings` of the judged continuations (--judge) that eval's --set takes, by name."""
EVAL_SETS = (*JUDGED_SETS, "batch_size")
"""eval's --set: the judged `GenSettings` above, and batch_size, the evaluation's
`EvalSettings.batch_size` (windows per forward pass, default 16; not the judge's)."""
JUDGED_FLAGS = {"steps_per_block": "--steps-per-block", "sampler": "--sampler", "seed": "--seed"}


def check_model_sampler(method: str | None, info: RunInfo) -> str | None:
    """The sampler a run takes for --sampler `method` (None: the default); a ConfigError (exit 2)
    for an unknown one. None for a reference (no sampler)."""
    if info.kind != "blocktrain":
        return method
    try:
        return sampler_for(method)
    except ValueError as exc:
        raise ConfigError(f"{exc}") from None


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """--steps-per-block and --sampler, defaulting to the best measured recipe."""
    p.add_argument(
        "--steps-per-block",
        type=int,
        default=DEFAULT_STEPS_PER_BLOCK,
        help="sampler points per block",
    )
    p.add_argument(
        "--sampler",
        default=None,
        help=f"the sampler's step between grid points: {', '.join(SAMPLERS)} (default: "
        f"{DEFAULT_SAMPLER})",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a run on held-out text",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a run folder written by train (or cluster, export), or a Hugging Face export "
        "(export --hf DIR)",
    )
    add_data_arg(p)
    p.add_argument("--split", default="valid", choices=("valid", "test"))
    p.add_argument("--bytes", type=int, default=32768, help="held-out bytes to evaluate")
    p.add_argument("--sweeps", type=int, default=16, help="M, sampler sweeps from pure noise")
    add_sampler_args(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the noise")
    p.add_argument(
        "--against",
        metavar="REF_RUN_DIR",
        help="also evaluate this reference run on the same bytes",
    )
    p.add_argument(
        "--judge",
        metavar="JUDGE_RUN_DIR",
        help="a reference run trained apart from the model (e.g. `train --preset judge "
        "--reference`): continue fixed prompts of the split and report the judge's CE on them "
        "(gen_ce), on the real continuations (floor_ce) and the outputs' byte entropy",
    )
    add_named_sets(
        p,
        GenSettings,
        JUDGED_FLAGS,
        "batch_size: windows per forward pass, default 16; the others with --judge; docs/model.md",
        EVAL_SETS,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_device_arg(p)
    add_threads_arg(p)
    add_progress_arg(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    use_threads(args)
    for name in ("bytes", "sweeps", "steps_per_block"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    judged = split_sets(args)[1]
    batch_size = judged.pop("batch_size", EvalSettings.batch_size)
    if batch_size <= 0:
        raise ConfigError(f"--set batch_size={batch_size} must be positive")
    try:
        gen_settings = GenSettings(
            steps_per_block=args.steps_per_block, sampler=args.sampler, seed=args.seed, **judged
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    info, model = load_model(Path(args.run_dir), device)
    check_model_sampler(args.sampler, info)
    ref = None
    if args.against:
        ref_info, ref = load_model(Path(args.against), device)
        if ref_info.kind != "reference":
            raise CheckpointError(f"--against {args.against} is not a reference run")
        if ref_info.config.model.seq_len != info.config.model.seq_len:
            raise CheckpointError("--against: the two runs use different seq_len")
    judge = None
    if args.judge:
        judge_info, judge = load_model(Path(args.judge), device)
        if judge_info.kind != "reference":
            raise CheckpointError(f"--judge {args.judge} is not a reference (autoregressive) run")
    patterns = file_patterns(args)
    data = check_data(Path(args.run_dir), args.data, (args.split,), patterns)
    source = load_split(args.data, args.split, patterns)
    windows = source.windows(info.config.model.seq_len, args.bytes)
    settings = EvalSettings(
        sweeps=args.sweeps,
        steps_per_block=args.steps_per_block,
        seed=args.seed,
        batch_size=batch_size,
        sampler=args.sampler,
    )
    result: dict[str, Any] = {"run_dir": str(args.run_dir), "kind": info.kind, "split": args.split}
    work = windows.shape[0] * (2 if ref is not None else 1)
    work += gen_settings.prompts if judge is not None else 0
    bar = progress_bar(args, total=work, unit="window", desc=f"eval {Path(args.run_dir).name}")
    if isinstance(model, Reference):
        result.update(evaluate_reference(model, windows, settings, bar.update))
    else:
        assert isinstance(model, BlockStack)
        if not model.has_all_blocks():
            raise CheckpointError(
                f"{args.run_dir} holds only block(s) {model.block_ids} of {info.config.model.blocks};"
                " evaluation needs the assembled model"
            )
        result.update(evaluate_blocktrain(model, windows, settings, bar.update))
    if ref is not None:
        assert isinstance(ref, Reference)
        result["reference"] = evaluate_reference(ref, windows, settings, bar.update)
    if judge is not None:
        assert isinstance(judge, Reference) and isinstance(model, BlockStack | Reference)
        span = gen_settings.prompt_bytes + gen_settings.continuation_bytes
        prompts = source.windows(span, span * gen_settings.prompts)
        result["generated"] = evaluate_generation(
            model, judge, prompts, gen_settings, progress=bar.update
        )
        result["generated"]["judge"] = str(args.judge)
    bar.close()
    result["data"] = data
    if args.json:
        print_json(result)
    else:
        _print_table(result)
    return 0


def _print_table(r: dict[str, Any]) -> None:
    print(f"{r['run_dir']} ({r['kind']}) on {r['split']}, {r['bytes']} bytes")
    if r["kind"] == "reference":
        print(
            f"  CE            {r['ce']:.4f} nats/byte  ({r['bits_per_byte']:.4f} bits/byte, "
            f"perplexity {r['perplexity']:.3f})"
        )
    else:
        if r["span"] == 1:
            print(
                f"  sampler CE    {r['sampler_ce']:.4f} nats/byte  ({r['bits_per_byte']:.4f} "
                f"bits/byte, perplexity {r['perplexity']:.3f}; M = {r['sweeps']} sweeps)"
            )
        else:
            print(
                f"  joint CE      {r['joint_ce']:.4f} nats/byte  (whole spans of K = {r['span']};"
                f" M = {r['sweeps']} sweeps)"
            )
            print(f"  marginal CE   {r['sampler_ce']:.4f}  (per byte; a diagnostic only at K > 1)")
        print(f"  from-noise CE {r['from_noise_ce']:.4f}  (one sweep)")
        print(f"  CE per step   {', '.join(f'{v:.3f}' for v in r['ce_per_step'])}")
        if r["oracle_ce"] is not None:
            print(
                f"  oracle CE     {r['oracle_ce']:.4f}  (per block "
                f"{', '.join(f'{v:.3f}' for v in r['oracle_ce_per_block'])})"
            )
    if "generated" in r:
        g = r["generated"]
        print(
            f"  generated     judge CE {g['gen_ce']:.3f} ± {g['gen_ce_sem']:.3f} nats/byte on "
            f"{g['prompts']} continuations of {g['continuation_bytes']} bytes (real text "
            f"{g['floor_ce']:.3f}); byte entropy {g['entropy']:.3f} (real {g['real_entropy']:.3f})"
        )
        print(f"  a sample      {g['samples'][0]['generated']!r}")
    if "reference" in r:
        print(f"  reference CE  {r['reference']['ce']:.4f}  (same bytes)")
    d = r["data"]
    split = d["splits"].get(r["split"], {})
    same = {None: "not recorded by the run", True: "as trained", False: "NOT as trained"}
    print(
        f"  data          {d['path']} ({r['split']} sha256 {split.get('sha256', '?')[:12]}; "
        f"{same[d['same_as_training']]})"
    )
