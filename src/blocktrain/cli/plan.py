"""`blocktrain plan`: the resolved config and what it costs, without training anything."""

from __future__ import annotations

import argparse

from blocktrain.cli.common import Formatter, add_config_args, print_json, resolve_config
from blocktrain.errors import ConfigError
from blocktrain.training.plan import plan

EXAMPLES = """examples:
  blocktrain plan --preset paper --json
  blocktrain plan --preset small --set layers=12 blocks=4
  blocktrain plan --shape seed-75b --json                   # the seed's 75.80B fp16 shape
  blocktrain plan --shape layers=24,d=4096,blocks=3 --hosts 3
  blocktrain plan --shape seed-75b,route=state             # only z between blocks
  blocktrain plan --shape seed-75b --throughput             # random weights, scaled to fit
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show a config's shape, parameters and memory",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
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
        action="store_true",
        help="also time one-sweep and autoregressive generation here, on random "
        "weights of the shape scaled down in width",
    )
    shape.add_argument(
        "--scale",
        type=int,
        help="width divisor for --throughput (default: the smallest power of "
        "two that fits 60M parameters)",
    )
    shape.add_argument("--bytes", type=int, default=64, help="output bytes for --throughput")
    p.set_defaults(handler=run)


def run_shape(args: argparse.Namespace) -> int:
    from blocktrain.serving.host import shapes

    if args.overrides:
        raise ConfigError("--shape replaces --preset/--set; put the settings in the SPEC")
    name, cfg = shapes.parse_shape(args.shape)
    result = shapes.shape_plan(name, cfg, args.hosts)
    if args.throughput:
        if args.bytes <= 0:
            raise ConfigError(f"--bytes {args.bytes} must be positive")
        divisor = args.scale if args.scale is not None else shapes.auto_scale(cfg)
        scaled = shapes.scale_shape(cfg, divisor)
        prompt = min(64, scaled.seq_len - args.bytes)
        if prompt < 1:
            raise ConfigError(
                f"--bytes {args.bytes} leaves no room for a prompt in T = {scaled.seq_len}"
            )
        result["throughput"] = {
            "width_divisor": divisor,
            "weights": "random (untrained)",
            "where": "this process, no network",
            **shapes.measure_throughput(scaled, prompt_bytes=prompt, output_bytes=args.bytes),
        }
    if args.json:
        print_json(result)
        return 0
    for line in shapes.format_plan(result):
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


def run(args: argparse.Namespace) -> int:
    if args.shape is not None:
        return run_shape(args)
    if args.hosts is not None or args.throughput or args.scale is not None:
        raise ConfigError("--hosts, --throughput and --scale go with --shape")
    result = plan(resolve_config(args))
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
    upstream = " + the frozen upstream clean streams" if m["route"] == "features" else ""
    print(f"  worker memory     {workers} GiB by block (weights, gradients, AdamW{upstream})")
    return 0
