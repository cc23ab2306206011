"""Research probe: how stale may a relayed upstream stream be? (issue 55, the cheapest test)

Every block of a `route = features` stack trains in one process, but block b never runs the
blocks before it: at step s it trains on the batch block b-1 trained on at step s - LAG, with
block b-1's clean-stream output on that batch as computed then (detached). LAG = 0 is a
synchronous relay (what one process can do); LAG = 1 a pipelined relay (SWARM-style, one step
behind); LAG = H a relay exchanged once a round of H steps. Block b starts at step b * LAG (no
stream before). Scored by `blocktrain eval` as bench/compose.py scores its rows.

What a cheaper stream costs (issue 56: every byte through a codec): `--quant int4` / `int2`
relay the features in 4 or 2 bits a value, relaystream's own codec (each token rotated, then
evenly spaced levels on its RMS; rows `int4-absmax` / `int2-absmax` are the codec before it),
and `--every K` relays one step in K, block b training K consecutive steps on each relayed
batch (the newest at least LAG steps old): K times fewer stream bytes, each sequence seen K
times downstream.

    python bench/relay_probe.py --preset tiny --blocks 3 --lags 0,1,25 --seeds 0
    python bench/relay_probe.py --lags 10 --quant int4 --seeds 0,1,2
    python bench/relay_probe.py --lags 10 --every 4 --seeds 0
    python bench/relay_probe.py --report     # only its section (docs/research/compose.md)
    python bench/relay_probe.py --codec-error benchmarks/work/compose/small-blocktrain-b3-l2-relay-1000-seed0
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from blocktrain import relaystream
from blocktrain.config import apply_overrides
from blocktrain.data import load_split, resolve_data_path
from blocktrain.model import BlockStack
from blocktrain.presets import preset
from blocktrain.training.checkpoint import load_model
from blocktrain.training.local import write_assembled
from blocktrain.training.loss import BlockLoss
from blocktrain.training.optim import learning_rate, make_optimizer, set_learning_rate
from blocktrain.training.step import _BATCH_SALT, _NOISE_SALT, stream_seed
from report import RESEARCH, ROOT, blocktrain, machine, update_section

SECTION_MD = RESEARCH / "compose.md"  # history: "Do blocks compose?" read in full

WORK = ROOT / "benchmarks" / "work" / "relay_probe"


def train_relay(cfg, data, lag: int, quant: str, every: int = 1) -> BlockStack:  # type: ignore[no-untyped-def]
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    stack = BlockStack(cfg.model, cfg.seed)
    loss = BlockLoss(cfg.model, stack.targets, None)
    relayed: dict[int, torch.Tensor | None] = {}
    loss.upstream = lambda b, x: relayed[b]  # type: ignore[assignment]
    opts = [make_optimizer(stack.block(b), cfg.train) for b in range(cfg.model.blocks)]
    # (step, x, u) per relayed step, per block; block b reads the newest at least LAG steps old
    fifos = [collections.deque() for _ in range(cfg.model.blocks)]
    tc = cfg.train
    for s in range(tc.steps):
        for b in range(cfg.model.blocks):
            if b == 0:
                gen = torch.Generator().manual_seed(stream_seed(cfg.seed, 0, s, _BATCH_SALT))
                x, u = data.sample(tc.batch_size, cfg.model.seq_len, gen), None
            else:
                fifo = fifos[b - 1]
                while len(fifo) > 1 and fifo[1][0] <= s - lag:
                    fifo.popleft()  # a newer relayed step is old enough
                if not fifo or fifo[0][0] > s - lag:
                    continue  # no stream yet
                _, x, u = fifo[0]
            block = stack.block(b)
            relayed[b] = u
            noise = torch.Generator().manual_seed(stream_seed(cfg.seed, b, s, _NOISE_SALT))
            parts = loss(block, b, x, noise)
            opts[b].zero_grad(set_to_none=True)
            parts.total.backward()
            torch.nn.utils.clip_grad_norm_(block.parameters(), tc.grad_clip)
            set_learning_rate(opts[b], learning_rate(s, tc))
            if b < cfg.model.blocks - 1 and s % every == 0:
                with torch.no_grad():  # the stream as it was computed in this step's forward
                    out = block.clean_stream(x, u)
                fifos[b].append((s, x, quantise(out, quant)))
            opts[b].step()
        if s % 100 == 0:
            print(f"step {s} loss {float(parts.total):.3f}", file=sys.stderr, flush=True)
    return stack


def quantise(u: torch.Tensor, how: str) -> torch.Tensor:
    """The features as a reader gets them back: relaystream's own codec at int8/int4/int2."""
    if how == "fp32":
        return u
    if how == "fp16":
        return u.half().float()
    bits = QUANT_BITS[how]
    return relaystream.dequantise(*relaystream.quantise(u, bits), bits, u.shape[-1])


def absmax(u: torch.Tensor, bits: int) -> torch.Tensor:
    """The packed codes before the rotation (ABSMAX_BITS): levels -L..L over the token's absmax."""
    top = (1 << (bits - 1)) - 1
    scale = u.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / top
    return (u / scale).round().clamp(-top, top) * scale


@torch.no_grad()
def codec_errors(run: Path, sequences: int = 32, seed: int = 0) -> dict:  # type: ignore[type-arg]
    """Each codec's ||decoded - u|| / ||u|| on the clean stream each block but the last relays,
    on `sequences` validation sequences of the run's length."""
    info, model = load_model(run)
    assert isinstance(model, BlockStack)
    cfg = info.config.model
    x = load_split(None, "valid").sample(
        sequences, cfg.seq_len, torch.Generator().manual_seed(seed)
    )
    codecs = {
        **{q: (lambda u, q=q: quantise(u, q)) for q in ("int8", "int4", "int2")},
        **{q: (lambda u, b=b: absmax(u, b)) for q, b in ABSMAX_BITS.items()},
    }
    rows, up = [], None
    for b in range(cfg.blocks - 1):
        u = model.block(b).clean_stream(x, up)
        for name, codec in codecs.items():
            err = float((codec(u) - u).norm() / u.norm())
            rows.append({"block": b, "quant": name, "rel_error": round(err, 4)})
        up = u
    return {
        "run": run.name,
        "tokens": sequences * cfg.seq_len,
        "d_model": cfg.d_model,
        "rows": rows,
    }


KEY = ("preset", "blocks", "lag", "quant", "every", "seed", "steps")
"""What makes a row (rows measured before `every` existed relay every step)."""

QUANT_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}
ABSMAX_BITS = {"int4-absmax": 4, "int2-absmax": 2}
"""Rows measured before the packed codes were rotated (relaystream's `blocktrain-relay-1`, last
held by 549164f): levels -L..L over the token's absmax, no rotation."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--lags", default="0,1,25")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--quant", default="int8", choices=tuple(QUANT_BITS))
    p.add_argument("--every", type=int, default=1, help="relay one step in K (default 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sweeps", type=int, default=16)
    p.add_argument("--report", action="store_true", help="only rewrite its section (SECTION_MD)")
    p.add_argument(
        "--codec-error",
        metavar="RUN",
        help="only measure each stream codec's relative error on the clean streams of a trained "
        "run folder (bench/compose.py's), on validation bytes",
    )
    args = p.parse_args()
    out_path = ROOT / "benchmarks" / "results" / "relay_probe.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {"rows": []}
    if args.report:
        update_section("relay-probe", markdown(results), SECTION_MD)
        return
    if args.codec_error:
        results["codec_error"] = codec_errors(Path(args.codec_error))
        out_path.write_text(json.dumps(results, indent=1) + "\n")
        update_section("relay-probe", markdown(results), SECTION_MD)
        return
    data = resolve_data_path(None)
    train = load_split(data, "train")
    command = "python bench/relay_probe.py " + " ".join(sys.argv[1:])
    results["commands"] = [c for c in results.get("commands", []) if c != command] + [command]
    results["machine"] = machine()
    lpb = {"tiny": 1, "small": 2}[args.preset]
    for seed in [int(s) for s in args.seeds.split(",")]:
        for lag in [int(v) for v in args.lags.split(",")]:
            sets = [f"blocks={args.blocks}", f"layers={args.blocks * lpb}", f"seed={seed}"]
            sets += ["route=features", f"threads={args.threads}", f"steps={args.steps}"]
            cfg = apply_overrides(preset(args.preset), sets)
            t0 = time.perf_counter()
            stack = train_relay(cfg, train, lag, args.quant, args.every)
            secs = time.perf_counter() - t0
            every = f"-every{args.every}" if args.every > 1 else ""
            run = WORK / f"{args.preset}-b{args.blocks}-lag{lag}-{args.quant}{every}-seed{seed}"
            blocks = {b: stack.block(b).state_dict() for b in range(args.blocks)}
            write_assembled(run, cfg, blocks, args.steps)
            argv = ["eval", str(run), "--split", "test", "--json", "-q"]
            argv += ["--threads", str(args.threads), "--bytes", "32768"]
            ev = json.loads(blocktrain([*argv, "--sweeps", str(args.sweeps)]))
            row = {
                "preset": args.preset,
                "blocks": args.blocks,
                "lag": lag,
                "quant": args.quant,
                "every": args.every,
                "seed": seed,
                "steps": args.steps,
                "test_ce": ev["sampler_ce"],
                "head_ce": ev["head_ce_per_block"][-1],
                "train_seconds": round(secs, 1),
            }
            print(json.dumps(row), flush=True)
            results["rows"] = [
                r
                for r in results["rows"]
                if {k: {"every": 1, **r}[k] for k in KEY} != {k: row[k] for k in KEY}
            ] + [row]
            out_path.write_text(json.dumps(results, indent=1) + "\n")
            update_section("relay-probe", markdown(results), SECTION_MD)


def markdown(results: dict) -> str:  # type: ignore[type-arg]
    """The mean CE by lag, stream codec and relay period over the seeds measured, each with its
    seeds and its stream bytes against int8 every step."""
    lines = [
        "Each row: every block of a `features` stack trained in one process, block b reading at "
        "step s what block b-1 output at the newest relayed step at least LAG old (its features "
        "in the row's codec, relaystream's own: int8 on the token's absmax, int4 and int2 the "
        "rotated token on its RMS; `-absmax` rows are the packed codes before the rotation, "
        "levels on the absmax), its batch "
        "too; every K: one step in K relayed, each used K steps; scored by `blocktrain eval` on "
        "the 32,768 test bytes of bench/compose.py (M = 16). LAG 0 is what `train` does under "
        "`route = relay`; LAG H what a worker does that takes a stream once a round of H steps. "
        "Stream bytes: a token's byte, its features and an fp32 scale, per step, against int8 "
        "every step.",
        "",
        "| preset | blocks | lag (steps) | codec | every K | stream bytes | steps | sampler CE | "
        "head CE | seeds |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    groups: dict[tuple, list[dict]] = {}  # type: ignore[type-arg]
    for r in results["rows"]:
        key = (r["preset"], r["blocks"], r["lag"], r["quant"], r.get("every", 1), r["steps"])
        groups.setdefault(key, []).append(r)
    for (name, blocks, lag, quant, every, steps), rows in sorted(groups.items()):
        ces = [r["test_ce"] for r in rows]
        se = f" ± {statistics.stdev(ces) / len(ces) ** 0.5:.3f}" if len(ces) > 1 else ""
        heads = statistics.fmean(r["head_ce"] for r in rows)
        seeds = ",".join(str(r["seed"]) for r in sorted(rows, key=lambda r: r["seed"]))
        d = preset(name).model.d_model
        share = (d * {**QUANT_BITS, **ABSMAX_BITS}[quant] / 8 + 5) / every / (d + 5)
        lines.append(
            f"| {name} | {blocks} | {lag} | {quant} | {every} | {share:.2f} | {steps} | "
            f"{statistics.fmean(ces):.3f}{se} | {heads:.3f} | {seeds} |"
        )
    lines += ["", "```sh", *results.get("commands", []), "```"]
    if err := results.get("codec_error"):
        names = list(dict.fromkeys(r["quant"] for r in err["rows"]))
        lines += [
            "",
            f"What each codec loses of a trained stream (`python bench/relay_probe.py "
            f"--codec-error benchmarks/work/compose/{err['run']}`): ||decoded - u|| / ||u|| on the "
            f"clean stream each block relays, {err['tokens']:,} validation tokens, d = "
            f"{err['d_model']}.",
            "",
            "| block | " + " | ".join(names) + " |",
            "|---:|" + "---:|" * len(names),
        ]
        for b in sorted({r["block"] for r in err["rows"]}):
            cells = {r["quant"]: r["rel_error"] for r in err["rows"] if r["block"] == b}
            lines.append(f"| {b} | " + " | ".join(f"{cells[n]:.3f}" for n in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
