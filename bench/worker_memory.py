"""Peak resident memory of a worker over one round, by route (issue 55's RSS bar): the trainer a
`blocktrain worker` builds (`training.local.LocalBlockTrainer`), at a shape where the weights
outweigh the interpreter, each route in a fresh process so that each peak is its own.

  - state: the block alone;
  - features: the block, and blocks 0..b-1 frozen (loaded as a round's upstream versions), rerun
    at every step;
  - relay: the block, a round's incoming stream spooled to disk (H steps, read a step at a
    time) and its own stream spooled out.

    python bench/worker_memory.py --set d_model=1024 layers=16 blocks=8 --steps 3

Writes benchmarks/results/worker_memory.json (ru_maxrss of each process, the resident memory
before the trainer was built, and the ratio of each route's peak to the state route's).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.model import init_block
from blocktrain.presets import preset
from blocktrain.relaystream import RelayStream, StreamWriter
from blocktrain.training.local import LocalBlockTrainer
from report import RESULTS, machine, update_section, write_json

ROUTES = ("state", "features", "relay")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one(args: argparse.Namespace) -> dict[str, object]:
    """This process: the worker of block `--block` (default: the last, or for relay the one
    before it, which both takes and relays a stream) trains `--steps` local steps."""
    torch.set_num_threads(args.threads)
    cfg = apply_overrides(preset(args.preset), [*args.overrides, f"route={args.one}"])
    blocks = cfg.model.blocks
    block = args.block if args.block is not None else blocks - 1
    if args.one == "relay" and args.block is None:
        block = max(0, blocks - 2)  # takes a stream and relays one: the largest relay worker
    train = load_split(None, "train")
    before = rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        spool = Path(tmp)
        trainer = LocalBlockTrainer(cfg, block, train, data_seed=1, spool=spool / "out")
        trainer.load(init_block(cfg.model, cfg.seed, block).state_dict())
        if trainer.upstream_blocks:
            trainer.load_upstream(
                {
                    b: init_block(cfg.model, cfg.seed, b).state_dict()
                    for b in trainer.upstream_blocks
                }
            )
        if trainer.relays_from is not None:  # a round's stream, on disk as a worker keeps it
            shape = trainer.stream_shape()
            writer = StreamWriter(shape, spool / "made")
            gen = torch.Generator().manual_seed(0)
            for _ in range(args.steps):
                x = torch.randint(0, 256, (shape.batch, shape.seq_len), generator=gen)
                writer.add(x, torch.randn(shape.batch, shape.seq_len, shape.d_model, generator=gen))
            body = writer.finish({"block": str(block - 1)})
            path = spool / "in.stream"
            with open(path, "wb") as f:
                for chunk in body.chunks():
                    f.write(chunk)
            body.close()
            trainer.load_stream(RelayStream.from_file(path, shape))
        started = time.perf_counter()
        trainer.train(args.steps, first_step=0)
        seconds = time.perf_counter() - started
        out = trainer.stream_out({"round": "0"})
        if out is not None:
            out.close()
    return {
        "route": args.one,
        "block": block,
        "blocks": blocks,
        "steps": args.steps,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_bytes": before,
        "train_seconds": round(seconds, 1),
        "params_block": sum(p.numel() for p in trainer.module.parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="small")
    p.add_argument(
        "--set", dest="overrides", nargs="+", default=["d_model=1024", "layers=16", "blocks=8"]
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--one", choices=ROUTES, help=argparse.SUPPRESS)
    p.add_argument("--report", action="store_true", help="only rewrite the BENCHMARKS.md section")
    args = p.parse_args()
    if args.report:
        update_section(
            "worker-memory", markdown(json.loads((RESULTS / "worker_memory.json").read_text()))
        )
        return
    if args.one:
        print(json.dumps(one(args)))
        return
    rows = []
    for route in ROUTES:
        argv = [sys.executable, __file__, "--one", route, "--preset", args.preset]
        argv += [
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--set",
            *args.overrides,
        ]
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        rows.append(row)
    state = next(r for r in rows if r["route"] == "state")["peak_rss_bytes"]
    for r in rows:
        r["ratio_to_state"] = round(r["peak_rss_bytes"] / state, 3)
    command = "python bench/worker_memory.py " + " ".join(
        [
            f"--preset {args.preset}",
            "--set",
            *args.overrides,
            f"--steps {args.steps}",
            f"--threads {args.threads}",
        ]
    )
    result = {"command": command, "machine": machine(), "rows": rows}
    write_json("worker_memory.json", result)
    update_section("worker-memory", markdown(result))


def markdown(result: dict[str, object]) -> str:
    rows = result["rows"]
    assert isinstance(rows, list)
    lines = [
        f"Command: `{result['command']}` (writes `benchmarks/results/worker_memory.json`). "
        "Peak resident memory (ru_maxrss) of one process per route that builds the worker's "
        "trainer (`LocalBlockTrainer`) and trains one round of its local steps: under "
        "`features` the last block, holding blocks 0..b-1 as a round's upstream versions; "
        "under `relay` the block before the last, which reads a spooled stream and spools its "
        "own; under `state` the last block.",
        "",
        "| route | block | params of the block | peak RSS (GiB) | vs state | train s (the round) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['route']} | {r['block']} of {r['blocks']} | {r['params_block']:,} | "
            f"{r['peak_rss_bytes'] / 1024**3:.2f} | {r['ratio_to_state']:.2f}x | "
            f"{r['train_seconds']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
