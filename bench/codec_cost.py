"""What a delta codec costs in CPU time against what it saves on the link: per update of one
block at the small shape, the worker's encode (`DeltaEncoder.compress` with its error-feedback
residual, then `update_body`) and the aggregator's decode (the safetensors parse and the whole
validation chain the service runs, `validation.DEFAULT_CHAIN`: names, shapes, dtypes, decode,
finite values, norm), each the fastest of --reps timed updates, beside the body's bytes.

A codec pays for itself when the seconds its smaller body saves on the link exceed the extra
CPU seconds it costs over fp16: saved_s = (fp16 body - body) x 8 / rate, at --mbit (default
100 Mbit/s, a good home uplink). Writes benchmarks/results/codec_cost.json and the
"codec-cost" section of BENCHMARKS.md.

    python bench/codec_cost.py
    python bench/codec_cost.py --wires fp16,sparse:0.01:2 --reps 9 --mbit 20
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from blocktrain.model import BlockStack
from blocktrain.presets import preset
from blocktrain.protocol.core.bodies import decode, update_body
from blocktrain.protocol.core.codecs import DeltaEncoder
from blocktrain.protocol.core.validation import BlockSpec, Candidate, Limits, validate
from report import machine, update_section, write_json

NAME = "codec_cost.json"
WIRES = "fp16,int8,topk:0.03,sparse:0.03:2,sparse:0.01:2,sparse:0.03:4,sparse:0.03:8,sparse:0.06:4"


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """The fastest wall seconds of `reps` calls of fn (on a shared machine the others are the
    neighbours' load, not the codec's cost, as timeit's docs argue), and its last result."""
    seconds, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - t0)
    return min(seconds), out


def measure(wire: str, weights: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    spec = BlockSpec.of(weights, "fp16", None if wire == "fp16" else wire)
    gen = torch.Generator().manual_seed(0)
    # A delta of the size AdamW moves a weight in a round (about lr x H), per tensor.
    deltas = [
        {k: 3e-3 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        for _ in range(reps + 1)
    ]
    encoder = DeltaEncoder(wire)
    encoder.compress(deltas[-1])  # a residual in place, as from the second round on
    pushes = iter(deltas)

    def encode() -> bytes:
        return update_body(0, encoder.compress(next(pushes)), base_version=0, round=0, tokens=1)

    encode_s, body = timed(encode, reps)

    def check() -> bool:
        candidate = Candidate(0, decode(body), spec, Limits(math.inf, 1 << 40))
        return validate(candidate).accepted

    decode_s, accepted = timed(check, reps)
    assert accepted, f"{wire}: the aggregator refused an honest body"
    return {
        "wire": wire,
        "body_bytes": len(body),
        "encode_ms": 1000 * encode_s,
        "decode_ms": 1000 * decode_s,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Per update of one block at the {result['preset']} shape ({result['params']:,} "
        f"parameters), the fastest of {result['reps']} on this machine "
        f"({result['machine']['cpu']}, {result['threads']} torch threads). Encode: the worker's "
        "error-feedback codec and body; decode: the aggregator's parse and whole validation "
        f"chain. Saved: the link seconds the smaller body saves against fp16 at "
        f"{result['mbit']:g} Mbit/s, less the extra CPU seconds of encode + decode.",
        "",
        "| wire | body bytes | of fp16 | encode ms | decode ms | link ms at the rate | net saved ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| `{r['wire']}` | {r['body_bytes']:,} | {r['of_fp16']:.3f} | {r['encode_ms']:.1f} | "
            f"{r['decode_ms']:.1f} | {r['link_ms']:.0f} | {r['net_saved_ms']:+.0f} |"
        )
    lines += ["", "```sh", result["command"], "```"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="small")
    p.add_argument("--wires", default=WIRES, help="comma-separated delta wires (fp16 first)")
    p.add_argument("--reps", type=int, default=9, help="timed updates per codec")
    p.add_argument("--mbit", type=float, default=100.0, help="link rate, Mbit/s")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    wires = args.wires.split(",")
    if wires[0] != "fp16":
        p.error("--wires must start with fp16, the baseline")
    if args.reps < 1 or args.mbit <= 0:
        p.error("--reps and --mbit must be positive")
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    block = BlockStack(cfg.model, cfg.seed, [0]).block(0)
    weights = {k: v.detach().float() for k, v in block.state_dict().items()}
    rows = [measure(w, weights, args.reps) for w in wires]
    base = rows[0]
    for r in rows:
        r["of_fp16"] = r["body_bytes"] / base["body_bytes"]
        r["link_ms"] = 1000 * r["body_bytes"] * 8 / (args.mbit * 1e6)
        extra_cpu = r["encode_ms"] + r["decode_ms"] - base["encode_ms"] - base["decode_ms"]
        r["net_saved_ms"] = base["link_ms"] - r["link_ms"] - extra_cpu
        print(
            f"{r['wire']:>16}: {r['body_bytes']:>10,} B ({r['of_fp16']:.3f}), encode "
            f"{r['encode_ms']:.1f} ms, decode {r['decode_ms']:.1f} ms, net {r['net_saved_ms']:+.0f} ms",
            flush=True,
        )
    result = {
        "command": " ".join(["python bench/codec_cost.py", *sys.argv[1:]]),
        "preset": args.preset,
        "params": sum(v.numel() for v in weights.values()),
        "reps": args.reps,
        "mbit": args.mbit,
        "threads": args.threads,
        "machine": machine(),
        "rows": rows,
    }
    write_json(NAME, result)
    update_section("codec-cost", markdown(result))


if __name__ == "__main__":
    main()
