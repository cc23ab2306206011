"""`blocktrain plan`: the resolved config and what it costs, without training anything: each
block's worker's memory, FLOPs per local step and bytes per round, and under a device profile
its seconds per step and per round and whether it fits (training/costs.py)."""

from __future__ import annotations

import argparse
from typing import Any

from blocktrain.cli.common import (
    Formatter,
    add_config_args,
    print_json,
    resolve_config,
    split_sets,
)
from blocktrain.config import RunConfig
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.training.costs import cost_plan
from blocktrain.training.plan import plan
from blocktrain.training.profiles import PROFILES, device_profile

GIB = 1024**3

EXAMPLES = """examples:
  blocktrain plan --preset paper --json
  blocktrain plan --preset small --set layers=12 blocks=4
  blocktrain plan --shape seed-75b --json                   # the seed's 75.80B fp16 shape
  blocktrain plan --shape layers=24,d=4096,blocks=3 --hosts 3
  blocktrain plan --shape seed-75b,route=state             # only z between blocks
  blocktrain plan --shape seed-75b --throughput             # random weights, scaled to fit
  blocktrain plan --shape seed-75b --throughput 16          # ... timing 16 output bytes
  blocktrain plan --shape seed-75b --throughput --set scale=64   # ... at 1/64 of the width
  blocktrain plan --preset small --profile cpu --local-steps 20   # seconds on this machine
  blocktrain plan --shape layers=32,d=4096,blocks=8,route=relay --profile consumer-gpu --json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show a config's shape, parameters and memory",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    add_config_args(p, own={"scale": int})  # --set scale=N: --throughput's width divisor
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--profile",
        default="consumer-gpu",
        metavar="NAME",
        help=f"the device a worker trains on, for its seconds and its fit: {', '.join(PROFILES)}",
    )
    p.add_argument(
        "--local-steps",
        type=int,
        default=AggregatorSettings().local_steps,
        metavar="H",
        help="local steps per round, for the bytes and seconds of a round",
    )
    shape = p.add_argument_group("logical shapes (serving and memory planning)")
    shape.add_argument(
        "--shape",
        metavar="SPEC",
        help="a named shape (seed-75b) or KEY=VALUE,... such as "
        "layers=33,d=13696,blocks=3 (keys: layers, d, blocks, heads, seq, "
        "span, mlp, noise_dim, route); instead of --preset/--set",
    )
    shape.add_argument("--hosts", type=int, help="serving hosts (default: one per block)")
    shape.add_argument(
        "--throughput",
        nargs="?",
        type=int,
        const=64,
        metavar="BYTES",
        help="also time one-sweep and autoregressive generation of BYTES output bytes (64 when "
        "left out) here, on random weights of the shape scaled down in width",
    )
    p.set_defaults(handler=run)


def run_shape(args: argparse.Namespace) -> int:
    from blocktrain.serving.host import shapes

    config, own = split_sets(args)
    if config:
        raise ConfigError("--shape replaces --preset/--set; put the settings in the SPEC")
    scale = own.get("scale")
    name, cfg = shapes.parse_shape(args.shape)
    result = shapes.shape_plan(name, cfg, args.hosts)
    result.update(costs(args, shapes.shape_run(cfg)))
    if args.throughput is not None:
        if args.throughput <= 0:
            raise ConfigError(f"--throughput {args.throughput} must be positive")
        divisor = scale if scale is not None else shapes.auto_scale(cfg)
        scaled = shapes.scale_shape(cfg, divisor)
        prompt = min(64, scaled.seq_len - args.throughput)
        if prompt < 1:
            raise ConfigError(
                f"--throughput {args.throughput} leaves no room for a prompt in T = "
                f"{scaled.seq_len}"
            )
        result["throughput"] = {
            "width_divisor": divisor,
            "weights": "random (untrained)",
            "where": "this process, no network",
            **shapes.measure_throughput(scaled, prompt_bytes=prompt, output_bytes=args.throughput),
        }
    if args.json:
        print_json(result)
        return 0
    for line in shapes.format_plan(result):
        print(line)
    for line in format_costs(result):
        print(line)
    if "throughput" in result:
        t = result["throughput"]
        m = t["model"]
        print(
            f"  throughput        scaled 1/{t['width_divisor']} in width (d = {m['d_model']}, "
            f"{t['params_total']:,} params, random weights, {t['torch_threads']} threads): "
            f"one sweep {t['one_sweep_bytes_per_s']:.1f} B/s, autoregressive "
            f"{t['ar_bytes_per_s']:.1f} B/s ({t['ratio']:.1f}x) for {t['output_bytes']} bytes"
        )
    return 0


def costs(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    """Each block's worker's costs under --profile, for --local-steps H."""
    if args.local_steps <= 0:
        raise ConfigError(f"--local-steps {args.local_steps} must be positive")
    profile = device_profile(args.profile)
    wire = AggregatorSettings().wire_dtype
    return cost_plan(cfg, profile, local_steps=args.local_steps, wire_dtype=wire)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _flop(flops: float) -> str:
    return f"{flops / 1e12:.4g} TFLOP" if flops >= 1e12 else f"{flops / 1e9:.4g} GFLOP"


def format_costs(result: dict[str, Any]) -> list[str]:
    """The text lines of the costs: each block's worker, the slowest and the fit."""
    profile, rows = result["profile"], result["per_block"]
    lines = [
        f"  profile           {profile['name']}: {profile['description']} "
        f"({profile['flops_per_s'] / 1e12:.3g} TFLOP/s sustained, "
        f"{_size(profile['memory_bytes'])})"
    ]
    for row in rows:
        lines.append(
            f"  block {row['block']:<11} {_flop(row['flops_per_step'])} a step "
            f"({row['step_s']:.3g} s), {row['bytes_per_round']['total'] / 1e6:,.1f} MB a round "
            f"of H = {result['local_steps']} ({row['round_s']:.3g} s), "
            f"{_size(row['memory_bytes'])}" + ("" if row["fits"] else " (does not fit)")
        )
    slowest = rows[result["slowest_block"]]
    lines.append(
        f"  slowest block     {result['slowest_block']}: {slowest['round_s']:.3g} s a round"
    )
    fewest = result["fewest_blocks_that_fit"]
    lines.append(
        f"  fit               the largest worker ({_size(result['largest_worker_bytes'])}, "
        f"activations not counted) {'fits' if result['fits'] else 'does not fit'} in "
        f"{_size(profile['memory_bytes'])}; "
        + (
            f"the fewest blocks that fit: {fewest}"
            if fewest is not None
            else "no number of blocks that divides the layers fits"
        )
    )
    for route, r in result["routes"].items():
        lines.append(
            f"  route {route:<11} largest worker {_size(r['largest_worker_bytes'])}"
            f"{'' if r['fits'] else ' (does not fit)'}, {_flop(r['largest_flops_per_step'])} "
            f"a step, slowest round {r['slowest_round_s']:.3g} s"
        )
    pick = result["recommended_route"]
    lines.append(
        f"  pick              route = {pick}: of the routes whose blocks compose, the one that "
        "fits with the shortest round"
        if pick is not None
        else "  pick              neither composing route fits this profile: more blocks"
    )
    return lines


def run(args: argparse.Namespace) -> int:
    if args.shape is not None:
        return run_shape(args)
    if args.hosts is not None or args.throughput is not None or "scale" in split_sets(args)[1]:
        raise ConfigError("--hosts, --throughput and --set scale go with --shape")
    cfg = resolve_config(args)
    result = plan(cfg)
    result.update(costs(args, cfg))
    if args.json:
        print_json(result)
        return 0
    m = result["config"]["model"]
    gib = 1024**3
    print(
        f"preset {result['config']['preset']}: {m['blocks']} blocks x "
        f"{result['layers_per_block']} layers, d = {m['d_model']}, T = {m['seq_len']}, "
        f"K = {m['span']}"
    )
    print(f"  sigma boundaries  {', '.join(f'{s:.4f}' for s in result['sigma_boundaries'])}")
    print(f"  params per block  {result['params_per_block'][0]:,}")
    print(
        f"  params total      {result['params_total']:,}  "
        f"(reference {result['reference_params']:,})"
    )
    print(
        f"  AdamW state       worker {result['optimizer_state_bytes_worker'] / gib:.4f} GiB, "
        f"full model {result['optimizer_state_bytes_full'] / gib:.4f} GiB"
    )
    workers = ", ".join(f"{b / gib:.4f}" for b in result["worker_state_bytes_per_block"])
    upstream = {
        "state": "",
        "features": " + the frozen upstream clean streams",
        "relay": " + a step of the relayed streams",
    }[m["route"]]
    print(
        f"  worker memory     {workers} GiB by block (weights, gradients, AdamW, the target "
        f"table{upstream})"
    )
    for line in format_costs(result):
        print(line)
    return 0
