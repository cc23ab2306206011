"""Do blocks compose? B blocks against one block and against end-to-end models of the same depth.

Every row is a `blocktrain train` run to the same step count, scored by `blocktrain eval` on the
same test bytes (the sampler CE over M sweeps for BlockTrain, the exact CE for a reference):

  - B blocks of L layers each, for each B in --blocks and each route in --routes (`state`: only
    the noisy state passes between blocks; `features`: block b+1 also reads block b's clean
    stream, docs/model.md);
  - one block of B x L layers for each B in --deep (the stack's depth trained end to end inside
    one block: B times a worker's memory);
  - the end-to-end references of L and of B x L layers.

From them, the depth delivered by blocks,

    D = (CE of 1 block of L layers - CE of B blocks) / (CE of 1 block of L - CE of 1 block of B x L)

and the same numerator over (reference of L layers - reference of B x L). Runs are kept under
benchmarks/work/compose/ and reused; each call adds its seeds to the rows already in
benchmarks/results/compose.json, so a row's `test_ce` is the mean over every seed measured.

    python bench/compose.py --preset tiny --blocks 1,2,3,6 --seeds 0
    python bench/compose.py --preset tiny --blocks 1,3 --seeds 1,2     # more seeds where it matters
    python bench/compose.py --preset tiny --cluster 6:40:25            # the stack over HTTP
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import load_split, resolve_data_path
from blocktrain.model import BlockStack, init_reference
from blocktrain.presets import preset
from blocktrain.simulate import REGIMES, SimSpec, simulate
from blocktrain.training import (
    EvalSettings,
    Trainer,
    evaluate_blocktrain,
    evaluate_reference,
    load_model,
)
from blocktrain.training.checkpoint import RunInfo
from blocktrain.training.costs import TRAINED_BYTES_PER_PARAM
from blocktrain.training.evaluate import head_nll
from blocktrain.training.flops import count_flops
from blocktrain.training.local import build_stack
from blocktrain.training.plan import plan
from blocktrain.training.profiles import PROFILES
from report import ROOT, blocktrain, exclusive, machine, trained, update_section, write_json

RESULT = "compose.json"
WORK = ROOT / "benchmarks" / "work" / "compose"
DEFAULT_SWEEPS = {"tiny": 16, "small": 64}


@dataclasses.dataclass(frozen=True)
class Row:
    preset: str
    model: str  # blocktrain or reference
    blocks: int
    layers_per_block: int
    route: str  # state, features, or end-to-end for a reference
    steps: int
    upstream_every: int = 1
    """Steps between refreshes of the upstream copy a block reads (1: always the latest)."""
    upstream_lag: int = 0
    """Refreshes the upstream copy lags behind: a worker that pulls upstream versions once a
    round of H = upstream_every steps, k rounds old."""
    intervals: str = "forward"
    """The model's `intervals`: `reversed` gives the last block the highest noise."""

    @property
    def key(self) -> str:
        key = (
            f"{self.preset}-{self.model}-b{self.blocks}-l{self.layers_per_block}-"
            f"{self.route}-{self.steps}"
        )
        stale = (self.upstream_every, self.upstream_lag) != (1, 0)
        key += f"-up{self.upstream_every}x{self.upstream_lag}" if stale else ""
        return key + ("-reversed" if self.intervals == "reversed" else "")

    def overrides(self, seed: int, threads: int) -> list[str]:
        layers = self.blocks * self.layers_per_block
        sets = [f"blocks={self.blocks}", f"layers={layers}", f"seed={seed}"]
        if self.model == "blocktrain":
            sets += [f"route={self.route}", f"intervals={self.intervals}"]
        return [*sets, f"threads={threads}", "eval_every=0"]

    def config(self, seed: int, threads: int) -> RunConfig:
        cfg = apply_overrides(preset(self.preset), self.overrides(seed, threads))
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=self.steps))


def grid(args: argparse.Namespace, data: Path) -> list[Row]:
    lpb = {"tiny": 1, "small": 2}.get(args.preset, 1)
    steps = args.steps
    one = Row(args.preset, "blocktrain", 1, lpb, "state", steps)
    rows = [] if args.stacks_only else [one]
    for b in (b for b in args.blocks if b > 1):
        rows += [Row(args.preset, "blocktrain", b, lpb, r, steps) for r in args.routes]
        for every, lag in args.stale:
            rows.append(Row(args.preset, "blocktrain", b, lpb, "features", steps, every, lag))
        if args.reversed:
            rows.append(
                Row(args.preset, "blocktrain", b, lpb, "features", steps, intervals="reversed")
            )
        if args.match_flops:  # one block trained as long as the features stack costs
            stack = Row(args.preset, "blocktrain", b, lpb, "features", steps)
            ratio = train_gflops(stack, stack.config(0, 1), data) / train_gflops(
                one, one.config(0, 1), data
            )
            rows.append(dataclasses.replace(one, steps=round(steps * ratio)))
    if args.stacks_only:
        return rows
    if not args.no_references:  # before the deep blocks: they cost the least
        for layers in sorted({lpb, *(b * lpb for b in args.deep)}):
            rows.append(Row(args.preset, "reference", 1, layers, "end-to-end", steps))
    for b in args.deep:
        rows.append(Row(args.preset, "blocktrain", 1, b * lpb, "state", steps))
    return rows


def train_gflops(row: Row, cfg: RunConfig, data: Path) -> float:
    """Training GFLOPs of the whole run, counted as the code runs on one batch: 3 x forward for
    what is trained (the backward costs twice the forward), 1 x forward for the upstream
    features (no gradient; none under relay, where they arrive with the batch)."""
    source = load_split(data, "train")
    kind = "reference" if row.model == "reference" else "blocktrain"
    blocks = [] if kind == "reference" else list(range(cfg.model.blocks))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(RunInfo(cfg, kind, blocks), Path(tmp), source, None)
    x = source.sample(cfg.train.batch_size, cfg.model.seq_len, torch.Generator().manual_seed(0))
    total = 0
    with torch.no_grad():
        for unit in trainer.units:
            # each count on its own copy of the batch: the stack keeps the upstream chain of the
            # last batch it saw (BlockStack.upstream), and a count that found it there would
            # miss its FLOPs (an earlier count did, and tripled features' upstream forwards)
            step = count_flops(
                lambda u=unit: u.objective(x.clone(), torch.Generator().manual_seed(0))
            )
            stack, upstream = trainer.stack, 0
            if stack is not None:
                upstream = count_flops(lambda u=unit, s=stack: s.upstream(u.index, x.clone())).total
            # relay: the features come relayed from the block before's own update, not rerun
            total += 3 * (step.total - upstream) + (0 if row.route == "relay" else upstream)
    return total * cfg.train.steps / 1e9


def worker_bytes(row: Row, cfg: RunConfig) -> int:
    """The largest worker's training memory (training/plan.py); a reference trains as one unit."""
    p = plan(cfg)
    if row.model == "reference":
        return p["reference_params"] * TRAINED_BYTES_PER_PARAM
    return max(p["worker_state_bytes_per_block"])


def train_stale(run: Path, row: Row, cfg: RunConfig, data: Path) -> None:
    """`blocktrain train`'s loop, with every block reading a copy of the stack that is
    refreshed every `upstream_every` steps and lags `upstream_lag` refreshes behind: what a
    worker sees that pulls the upstream versions once a round."""
    state = run / "state.json"
    if state.exists() and json.loads(state.read_text())["step"] >= cfg.train.steps:
        return
    trainer = Trainer.create(cfg, run, load_split(data, "train"), None, overwrite=True)
    assert trainer.stack is not None
    stale = BlockStack(cfg.model, cfg.seed).to(trainer.device).eval()
    for unit in trainer.units:
        loss = unit.objective.func  # type: ignore[attr-defined]  # partial(BlockLoss, block, b)
        loss.upstream = stale.upstream
    kept: list[dict[str, torch.Tensor]] = []
    for start in range(0, cfg.train.steps, row.upstream_every):
        kept = [*kept, copy.deepcopy(trainer.stack.state_dict())][-(row.upstream_lag + 1) :]
        stale.load_state_dict(kept[0])
        trainer.run(progress=False, until=start + row.upstream_every)


def measure(row: Row, seed: int, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    run = WORK / f"{row.key}-seed{seed}"
    if (row.upstream_every, row.upstream_lag) != (1, 0):
        print(f"training {run} in process (stale upstream)", file=sys.stderr, flush=True)
        train_stale(run, row, row.config(seed, args.threads), data)
    else:
        argv = ["--preset", row.preset, "--steps", str(row.steps)]
        argv += ["--reference"] if row.model == "reference" else []
        trained(run, [*argv, "--set", *row.overrides(seed, args.threads)])
    # on --threads (train takes its own from the run's config): at torch's default an eval took
    # both cores beside another bench
    argv = ["eval", str(run), "--split", "test", "--json", "-q", "--threads", str(args.threads)]
    ev = json.loads(blocktrain([*argv, "--bytes", str(args.bytes), "--sweeps", str(args.sweeps)]))
    state = json.loads((run / "state.json").read_text())
    out = {"test_ce": ev["ce"] if row.model == "reference" else ev["sampler_ce"]}
    if row.model == "blocktrain":  # eval's figures, the head exit's among them
        out["from_noise_ce"] = ev["from_noise_ce"]
        out["sampler_ce_per_step"] = ev["sampler_ce_per_step"]
        out["head_ce_per_block"] = ev["head_ce_per_block"]
    return {**out, "train_seconds": round(state["wall_seconds"], 1)}


def head_ces(run: Path, test: torch.Tensor, batch: int = 16) -> list[float]:
    """Each block's head CE on bytes 1..T-1 of the test windows: eval's head_ce_per_block, in
    this process, for a run scored before eval reported it."""
    _, stack = load_model(run)
    assert isinstance(stack, BlockStack)
    nll = [0.0] * stack.cfg.blocks
    for start in range(0, test.shape[0], batch):
        for b in range(stack.cfg.blocks):
            nll[b] += head_nll(stack, b, test[start : start + batch])
    return [v / (test.shape[0] * (test.shape[1] - 1)) for v in nll]


def summarise(row: Row, by_seed: dict[str, Any], cfg: RunConfig, data: Path) -> dict[str, Any]:
    ces = [r["test_ce"] for r in by_seed.values()]
    heads = [r["head_ce_per_block"][-1] for r in by_seed.values() if r.get("head_ce_per_block")]
    return {
        **dataclasses.asdict(row),
        "train_gflops": round(train_gflops(row, cfg, data), 1),
        "test_ce": statistics.fmean(ces),
        "head_ce": statistics.fmean(heads) if len(heads) == len(ces) else None,
        "test_ce_se": statistics.stdev(ces) / len(ces) ** 0.5 if len(ces) > 1 else None,
        "seeds": sorted(int(s) for s in by_seed),
        "worker_state_bytes": worker_bytes(row, cfg),
        "by_seed": by_seed,
    }


def depth_delivered(rows: list[dict[str, Any]], preset_name: str) -> list[dict[str, Any]]:
    """D for every stack that has its one-block and deep-block rows, per route. Each ratio reads
    its rows on the seeds they share (`D_seeds`, `D_reference_seeds`): a row measured on more
    seeds than the others would otherwise move D by its extra seeds' luck alone (one seed moves
    a row by up to 0.03 at tiny), not by composition."""

    def find(model: str, blocks: int, lpb: int, route: str, steps: int) -> dict[str, Any] | None:
        for r in rows:
            same = (r["preset"], r["model"], r["blocks"], r["layers_per_block"], r["route"])
            fresh = (r.get("upstream_every", 1), r.get("upstream_lag", 0)) == (1, 0)
            forward = r.get("intervals", "forward") == "forward"
            wanted = same == (preset_name, model, blocks, lpb, route) and r["steps"] == steps
            if wanted and fresh and forward:
                return r
        return None

    def shared(*found: dict[str, Any] | None) -> list[str]:
        """The seeds every row of `found` was measured on (none when one is missing)."""
        if any(r is None for r in found):
            return []
        seeds = set.intersection(*(set(r["by_seed"]) for r in found if r is not None))
        return sorted(seeds, key=int)

    def ce(r: dict[str, Any], seeds: list[str], exit_: str = "sampler") -> float:
        """The row's mean CE over `seeds`: its sampler's (a reference's exact CE), or with
        `exit_ = "best"` the better of that and its last block's head, where it was read."""
        sampler = statistics.fmean(r["by_seed"][s]["test_ce"] for s in seeds)
        heads = [r["by_seed"][s].get("head_ce_per_block") for s in seeds]
        if exit_ == "sampler" or not all(heads):
            return sampler
        return min(sampler, statistics.fmean(h[-1] for h in heads if h))

    out = []
    lpb = min(r["layers_per_block"] for r in rows if r["preset"] == preset_name)
    for r in rows:
        b, steps = r["blocks"], r["steps"]
        one = find("blocktrain", 1, lpb, "state", steps)
        if r["preset"] != preset_name or r["model"] != "blocktrain" or b == 1 or one is None:
            continue
        deep = find("blocktrain", 1, b * lpb, "state", steps)
        refs = (
            find("reference", 1, lpb, "end-to-end", steps),
            find("reference", 1, b * lpb, "end-to-end", steps),
        )
        seeds = shared(r, one, deep)
        pair = shared(r, one)  # the stack's gain, for the references' ratio
        ref_seeds = shared(*refs)
        D = D_best = D_ref = None
        if seeds:  # (one - stack) / (one - deep), each read on the same seeds
            assert deep is not None
            one_ce, deep_ce = ce(one, seeds), ce(deep, seeds)
            D = (one_ce - ce(r, seeds)) / (one_ce - deep_ce)
            one_best, deep_best = ce(one, seeds, "best"), ce(deep, seeds, "best")
            D_best = (one_best - ce(r, seeds, "best")) / (one_best - deep_best)
        if pair and ref_seeds:
            ref_one, ref_deep = (ce(x, ref_seeds) for x in refs if x is not None)
            D_ref = (ce(one, pair) - ce(r, pair)) / (ref_one - ref_deep)
        out.append(
            {
                "preset": preset_name,
                "blocks": b,
                "route": r["route"],
                "upstream_every": r.get("upstream_every", 1),
                "upstream_lag": r.get("upstream_lag", 0),
                "intervals": r.get("intervals", "forward"),
                "D": D,
                "D_best_exit": D_best,
                "D_reference": D_ref,
                "D_seeds": [int(s) for s in seeds],
                "D_reference_seeds": [int(s) for s in pair] if ref_seeds else [],
            }
        )
    return out


DILOCO = {"outer_lr": 0.7, "outer_momentum": 0.9}
"""DiLoCo's published outer Nesterov (Douillard et al. 2023)."""
HEAD_TO_HEAD = (
    ("blocktrain", 3, 1, "state"),
    ("blocktrain", 3, 1, "features"),
    ("blocktrain", 3, 1, "relay"),
    ("reversed", 3, 1, "features"),
    ("blocktrain", 1, 1, "state"),
    ("diloco", 1, 1, "end-to-end"),
    ("diloco", 1, 3, "end-to-end"),
    ("averaged", 1, 1, "end-to-end"),
    ("averaged", 1, 3, "end-to-end"),
    ("b6", 6, 1, "state"),
    ("b6", 6, 1, "features"),
    ("b6", 6, 1, "relay"),
    ("diloco", 1, 6, "end-to-end"),
    ("averaged", 1, 6, "end-to-end"),
)
"""The decentralised rows: (method, blocks, layers as a multiple of one block's, route); W
workers spread evenly over the blocks. `b6`: the six-block stacks (one worker a block at W = 6). `reversed`: the features stack with intervals reversed,
read through its head exit. DiLoCo trains the end-to-end reference as one unit with
its outer Nesterov; `averaged` the same unit with plain averaging, as the blocks are."""
METHODS = sorted({method for method, *_ in HEAD_TO_HEAD})


def methods_named(
    args: argparse.Namespace, steps: int
) -> Iterator[tuple[str, int, str, Row, RunConfig]]:
    """The head-to-head's rows that --methods, --blocks, --routes and --deep name (end to end:
    one block's depth, or B's), each as (method, blocks, route, its Row, its config)."""
    lpb = {"tiny": 1, "small": 2}.get(args.preset, 1)
    for method, blocks, depth, route in HEAD_TO_HEAD:
        if method not in args.methods:
            continue
        end_to_end = method in ("diloco", "averaged")
        if end_to_end and depth not in {1, *args.deep}:
            continue
        if not end_to_end and (blocks not in args.blocks or route not in args.routes):
            continue
        model = "reference" if end_to_end else "blocktrain"
        intervals = "reversed" if method == "reversed" else "forward"
        row = Row(args.preset, model, blocks, depth * lpb, route, steps, intervals=intervals)
        yield method, blocks, route, row, row.config(args.seeds[0], args.threads)


def head_to_head(args: argparse.Namespace, data: Path) -> Iterator[dict[str, Any]]:
    """The simulator with real local training: W workers, each holding one unit (a block, or
    DiLoCo's end-to-end replica), R rounds of H local steps, the lockstep regime, no effect
    probe; the final model's CE on the bench's test bytes (a stack's sampler CE). Each method's
    row as it is measured."""
    workers, rounds, h = args.simulate
    test = load_split(data, "test").windows(preset(args.preset).model.seq_len, args.bytes)
    for method, blocks, route, row, cfg in methods_named(args, rounds * h):
        end_to_end = row.model == "reference"
        protocol: dict[str, Any] = {"local_steps": h, "effect_probe": "off"}
        protocol |= DILOCO if method == "diloco" else {}
        unit = "reference" if end_to_end else "block"
        spec = SimSpec(cfg, workers, rounds, protocol, seed=cfg.seed, unit=unit)
        print(f"simulating {row.key} with {workers} workers", file=sys.stderr, flush=True)
        report, weights = simulate(
            spec, [REGIMES["lockstep"]], load_split(data, "train"), load_split(data, "valid")
        )
        result = report["regimes"]["lockstep"]
        head = None
        if end_to_end:
            reference = init_reference(cfg.model, cfg.seed).eval()
            reference.load_state_dict(weights["lockstep"][0])
            ce = evaluate_reference(reference, test, EvalSettings(seed=0))["ce"]
            params = plan(cfg)["reference_params"]
        else:
            stack = build_stack(cfg, weights["lockstep"])
            ev = evaluate_blocktrain(stack, test, EvalSettings(sweeps=args.sweeps, seed=0))
            ce, head = ev["sampler_ce"], ev["head_ce_per_block"][-1]
            params = plan(cfg)["params_total"]
        name = method_name(method, blocks, row.layers_per_block, route)
        yield (
            {
                "method": name,
                "preset": args.preset,
                "blocks": blocks,
                "layers": cfg.model.layers,
                "route": route,
                "params_total": params,
                "workers": workers,
                "rounds": rounds,
                "local_steps": h,
                "outer": {
                    k: protocol.get(k, v) for k, v in (("outer_lr", 1.0), ("outer_momentum", 0.0))
                },
                "bytes_moved": result["bytes"]["down"] + result["bytes"]["up"],
                "stream_bytes": result["bytes"].get("stream_up", 0),
                "virtual_time_s": result["virtual_time_s"],
                "profile": report["profile"]["name"],
                "accepted": result["updates"]["accepted"],
                "worker_state_bytes": worker_bytes(row, cfg),
                "test_ce": ce,
                "head_ce": head,
                "seed": cfg.seed,
            }
        )
        print(f"  test CE {ce:.4f}, head CE {head}", file=sys.stderr, flush=True)


CLOCK_PROFILES = ("cpu", "consumer-gpu")
"""The profiles `--clock` times the head-to-head's methods under."""


def method_name(method: str, blocks: int, layers: int, route: str) -> str:
    return {
        "diloco": f"DiLoCo, {layers}-layer replicas",
        "averaged": f"end-to-end {layers}-layer replicas, averaged",
        "reversed": f"BlockTrain B = {blocks}, features, intervals reversed",
    }.get(method, f"BlockTrain B = {blocks}, {route}")


def clock(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The head-to-head's methods on the simulator's clock, with no training (`--timing-only`:
    the honest workers' bytes, zero deltas): each profile's virtual seconds for the R rounds,
    the bytes moved and the largest worker's memory, whatever the CE (which lockstep training
    does not change). W workers, R rounds of H local steps, lockstep, no effect probe."""
    workers, rounds, h = args.clock
    for method, blocks, route, row, cfg in methods_named(args, rounds * h):
        end_to_end = row.model == "reference"
        if method == "averaged":  # DiLoCo's bytes and seconds
            continue
        # rounds close once every replica reported: the work, not the protocol's minimum round
        protocol: dict[str, Any] = {"local_steps": h, "effect_probe": "off", "min_round_s": 0.0}
        protocol |= DILOCO if method == "diloco" else {}
        unit = "reference" if end_to_end else "block"
        timed: dict[str, Any] = {}
        for name in CLOCK_PROFILES:
            spec = SimSpec(
                cfg, workers, rounds, protocol, seed=cfg.seed, unit=unit, timing_only=True,
                profile=PROFILES[name],
            )  # fmt: skip
            report, _ = simulate(spec, [REGIMES["lockstep"]], None, None)
            result = report["regimes"]["lockstep"]
            timed[name] = {
                "virtual_time_s": result["virtual_time_s"],
                "round_s": result["virtual_time_s"] / rounds,
            }
        yield {
            "method": method_name(method, blocks, row.layers_per_block, route),
            "preset": args.preset,
            "blocks": blocks,
            "layers": cfg.model.layers,
            "route": route,
            "workers": workers,
            "rounds": rounds,
            "local_steps": h,
            "bytes_moved": result["bytes"]["down"] + result["bytes"]["up"],
            "stream_bytes": result["bytes"].get("stream_up", 0),
            "worker_state_bytes": worker_bytes(row, cfg),
            "profiles": timed,
        }


def over_http(args: argparse.Namespace, data: Path, rows: dict[str, Any]) -> dict[str, Any]:
    """`blocktrain cluster`: W worker processes and the aggregator over real HTTP on loopback
    train the B = 3 features stack (intervals reversed with --reversed) for R rounds of H local
    steps (the schedule spanning R x H steps, as `train`'s does), no effect probe; the final
    model scored as the rows are, by both exits, against the single-process row of the same
    steps and seed (trained here if it is missing). With W = 3 each block has one replica and
    sees the single-process run's data; with more, each update averages W / 3 replicas."""
    workers, rounds, h = args.cluster
    lpb = {"tiny": 1, "small": 2}.get(args.preset, 1)
    seed = args.seeds[0]
    intervals = "reversed" if args.reversed else "forward"
    row = Row(args.preset, "blocktrain", 3, lpb, "features", rounds * h, intervals=intervals)
    single = rows.get(row.key, {}).get("by_seed", {}).get(str(seed)) or measure(
        row, seed, args, data
    )
    out = WORK / f"cluster-{row.key}-w{workers}-h{h}-seed{seed}"
    sets = [s for s in row.overrides(seed, 1) if not s.startswith("threads=")]
    if not (out / "summary.json").exists():
        argv = ["cluster", "--preset", row.preset, "--workers", str(workers), "--rounds",
                str(rounds), "--local-steps", str(h), "--set", *sets, "round_eval_sweeps=1", "--data", str(data),
                "--eval-bytes", "1024", "--final-bytes", "1024",
                "--final-sweeps", "1", "--out", str(out), "--overwrite", "-q"]  # fmt: skip
        blocktrain(argv)
    argv = ["eval", str(out / "model"), "--split", "test", "--json", "-q"]
    argv += ["--threads", str(args.threads)]
    ev = json.loads(blocktrain([*argv, "--bytes", str(args.bytes), "--sweeps", str(args.sweeps)]))
    summary = json.loads((out / "summary.json").read_text())
    return {
        "preset": args.preset,
        "blocks": row.blocks,
        "layers_per_block": lpb,
        "route": row.route,
        "intervals": row.intervals,
        "workers": workers,
        "rounds": rounds,
        "local_steps": h,
        "seed": seed,
        "cluster_test_ce": ev["sampler_ce"],
        "single_test_ce": single["test_ce"],
        "gap": ev["sampler_ce"] - single["test_ce"],
        "cluster_head_ce": ev["head_ce_per_block"][-1],
        "single_head_ce": single["head_ce_per_block"][-1],
        "head_gap": ev["head_ce_per_block"][-1] - single["head_ce_per_block"][-1],
        "bytes_moved": summary["bytes"]["total"],
        "wall_seconds": summary["wall_seconds"],
        "updates": summary["updates"],
        "participation_mean": summary["participation_mean"],
    }


def route_label(r: dict[str, Any]) -> str:
    every, lag = r.get("upstream_every", 1), r.get("upstream_lag", 0)
    label = str(r["route"])
    if (every, lag) != (1, 0):
        label += f", upstream every {every} steps, {lag} behind"
    return label + (", intervals reversed" if r.get("intervals") == "reversed" else "")


def markdown(result: dict[str, Any]) -> str:
    mib = 1024**2
    sweeps = ", ".join(f"{m} at {name}" for name, m in result["sweeps"].items())
    lines = [
        f"Each row a `blocktrain train` run, scored on the same {result['test_bytes']:,} test "
        f"bytes (BlockTrain: sampler CE over M sweeps, M = {sweeps}; a reference: its exact CE); "
        "`test_ce` is the mean over the seeds listed, with its standard error where there are "
        "several. Head CE: the same bytes by the last block's next-byte head over the chain of "
        "clean streams (`generate --exit head`, no sampler; the mean over the seeds). Worker "
        "MiB: the largest worker's weights, gradients and AdamW moments and the target table, "
        "plus the frozen 16-bit upstream clean streams under `features`, or one step of the "
        "relayed streams in and out under `relay` (training/costs.py). Train GFLOP: the whole "
        "stack's, counted as the code runs (under `relay` the features come with the batch, "
        "under `features` each worker reruns the blocks before its own).",
        "",
        "| preset | model | blocks x layers | route | steps | train GFLOP | worker MiB | test CE | head CE | seeds |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        se = f" ± {r['test_ce_se']:.3f}" if r["test_ce_se"] else ""
        lines.append(
            f"| {r['preset']} | {r['model']} | {r['blocks']} x {r['layers_per_block']} | "
            f"{route_label(r)} | {r['steps']} | {r['train_gflops']:.0f} | "
            f"{r['worker_state_bytes'] / mib:.2f} | {r['test_ce']:.3f}{se} | "
            f"{'' if r.get('head_ce') is None else format(r['head_ce'], '.3f')} | "
            f"{','.join(map(str, r['seeds']))} |"
        )
    lines += [
        "",
        "D (best exit): each of the three models (one block, the stack, the deep block) by the "
        "better of its two exits, the sampler and the head. Each D reads its rows on the seeds "
        "they share (D seeds; the references' ratio reads the stack against one block on the "
        "stack's seeds), so a row measured on more seeds does not move D by their luck.",
        "",
        "| preset | blocks | route | D (deep block) | D (references) | D (best exit) | D seeds |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for d in result["depth"]:
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(
            f"| {d['preset']} | {d['blocks']} | {route_label(d)} | {fmt(d['D'])} | "
            f"{fmt(d['D_reference'])} | {fmt(d.get('D_best_exit'))} | "
            f"{','.join(map(str, d.get('D_seeds') or d.get('D_reference_seeds') or [])) or 'n/a'} |"
        )
    if result.get("head_to_head"):
        lines += [
            "",
            "Decentralised, in the simulator with real local training (lockstep regime, no "
            "effect probe, fp16 wire): every worker holds one unit, a block or DiLoCo's "
            "end-to-end replica; a reference's CE is exact, a stack's the sampler CE (head CE: "
            "its head exit, for the rows simulated since eval reports it). Virtual seconds: "
            "the rows with a profile ran on the simulator's honest clock (each step its "
            "block's FLOPs over the profile's rate, each message its bytes over its link; "
            "`cpu`: this machine's measured rate); the others on the old constant 0.5 s step.",
            "",
            "| method | seed | params | workers | rounds x H | outer lr, momentum | bytes moved (MB) | of them streams | virtual s | clock | worker MiB | test CE | head CE |",
            "|---|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in result["head_to_head"]:
            lines.append(
                f"| {r['method']} | {r['seed']} | {r['params_total']:,} | {r['workers']} | "
                f"{r['rounds']} x {r['local_steps']} | "
                f"{r['outer']['outer_lr']}, {r['outer']['outer_momentum']} | "
                f"{r['bytes_moved'] / 1e6:.1f} | {r.get('stream_bytes', 0) / 1e6:.1f} | "
                f"{r['virtual_time_s']:.0f} | {r.get('profile', 'constant 0.5 s')} | "
                f"{r['worker_state_bytes'] / mib:.2f} | "
                f"{r['test_ce']:.3f} | "
                f"{'' if r.get('head_ce') is None else format(r['head_ce'], '.3f')} |"
            )
    if result.get("clock"):
        lines += [
            "",
            "On the honest clock (`--clock`, timing only: the same workers, rounds and bytes, "
            "no training; a round closes once every replica reported, no minimum round): the "
            "simulator's virtual seconds a round, each step its worker's "
            "FLOPs over the profile's sustained rate, each message its bytes over the "
            "profile's link (training/profiles.py: `cpu` this machine's measured rate on a home "
            "link, `consumer-gpu` an RTX 4060 on one); the round waits for its slowest worker.",
            "",
            "| method | workers | rounds x H | bytes moved (MB) | of them streams | worker MiB | round s, cpu | round s, consumer-gpu |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in result["clock"]:
            p = r["profiles"]
            lines.append(
                f"| {r['method']} | {r['workers']} | {r['rounds']} x {r['local_steps']} | "
                f"{r['bytes_moved'] / 1e6:.1f} | {r['stream_bytes'] / 1e6:.1f} | "
                f"{r['worker_state_bytes'] / mib:.2f} | {p['cpu']['round_s']:.2f} | "
                f"{p['consumer-gpu']['round_s']:.2f} |"
            )
    if result.get("over_http"):
        lines += [
            "",
            "Over HTTP: `blocktrain cluster` on this machine (worker processes and the "
            "aggregator on loopback, no effect probe, fp16 wire), the features stack scored on "
            "the same test bytes by both exits, against the single-process `train` row of the "
            "same steps and seed (each cluster update is the mean of W / 3 replicas' deltas).",
            "",
            "| preset | stack | workers | rounds x H | single-process CE | cluster CE | gap | single head CE | cluster head CE | head gap |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["over_http"]:
            heads = (
                f"{r['single_head_ce']:.3f} | {r['cluster_head_ce']:.3f} | {r['head_gap']:+.3f}"
                if "head_gap" in r
                else " | | "
            )
            lines.append(
                f"| {r['preset']} | {route_label({'route': 'features', **r})} | {r['workers']} | "
                f"{r['rounds']} x {r['local_steps']} | {r['single_test_ce']:.3f} | "
                f"{r['cluster_test_ce']:.3f} | {r['gap']:+.3f} | {heads} |"
            )
    lines += ["", "```sh", *result["commands"], "```"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    p.add_argument("--steps", type=int, default=1000, help="training steps of every row")
    p.add_argument("--blocks", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 3, 6])
    p.add_argument("--routes", type=lambda s: s.split(","), default=["state", "features"])
    p.add_argument(
        "--deep",
        type=lambda s: [int(v) for v in s.split(",") if v],
        default=[3],
        help="B values whose one-block-of-B x L-layers row and references are run",
    )
    p.add_argument(
        "--stale",
        type=lambda s: [tuple(int(v) for v in item.split(":")) for item in s.split(",") if item],
        default=[],
        help="EVERY:LAG,...: features rows whose upstream copy is refreshed every EVERY steps, "
        "LAG refreshes behind",
    )
    p.add_argument(
        "--reversed",
        action="store_true",
        help="also a features row with intervals = reversed for each B > 1 (with --cluster: the "
        "reversed stack instead of the forward one)",
    )
    p.add_argument(
        "--stacks-only",
        action="store_true",
        help="only the B > 1 rows: no one-block, deep-block or reference rows",
    )
    p.add_argument(
        "--no-references",
        action="store_true",
        help="no end-to-end reference rows (run them later: rows already measured are kept)",
    )
    p.add_argument(
        "--match-flops",
        action="store_true",
        help="also train one block for as many FLOPs as each features stack",
    )
    p.add_argument(
        "--simulate",
        type=lambda s: tuple(int(v) for v in s.split(":")),
        help="W:R:H: (only) the decentralised head-to-head in the simulator: W workers, R "
        "rounds of H local steps",
    )
    p.add_argument(
        "--clock",
        type=lambda s: tuple(int(v) for v in s.split(":")),
        help="W:R:H: (only) the head-to-head's methods on the simulator's clock under the "
        f"profiles {', '.join(CLOCK_PROFILES)}, timing only (no training: seconds and bytes)",
    )
    p.add_argument(
        "--cluster",
        type=lambda s: tuple(int(v) for v in s.split(":")),
        help="W:R:H: (only) the B = 3 features stack trained by `blocktrain cluster` over HTTP "
        "(W workers, R rounds of H local steps) against its single-process row",
    )
    p.add_argument(
        "--methods",
        type=lambda s: s.split(","),
        default=METHODS,
        help=f"with --simulate: which rows, of {', '.join(METHODS)} (default all, so one build "
        "times the whole table); others are kept",
    )
    p.add_argument(
        "--recount",
        action="store_true",
        help="with --report: count every row's training FLOPs and worker memory again, by the "
        "code as it is now (the scores stay as measured)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing: recompute D and the BENCHMARKS.md section from the JSON",
    )
    p.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0])
    p.add_argument("--sweeps", type=int, help="M of the sampler CE (default: 16 tiny, 64 small)")
    p.add_argument("--bytes", type=int, default=32768, help="test bytes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    args = p.parse_args()
    args.sweeps = args.sweeps or DEFAULT_SWEEPS[args.preset]
    torch.set_num_threads(args.threads)
    data = resolve_data_path(args.data)
    if args.report:
        with exclusive("compose"):
            old = stored()
            if args.recount:  # every row's FLOPs and worker memory by the code as it is now
                for r in old["rows"]:
                    row = Row(**{k: r[k] for k in Row.__dataclass_fields__ if k in r})
                    cfg = row.config(0, args.threads)
                    r["train_gflops"] = round(train_gflops(row, cfg, data), 1)
                    r["worker_state_bytes"] = worker_bytes(row, cfg)
            presets = sorted({r["preset"] for r in old["rows"]})
            old["depth"] = [d for name in presets for d in depth_delivered(old["rows"], name)]
            write_json(RESULT, old)
            update_section("compose", markdown(old))
        print(markdown(old))
        return
    command = "python bench/compose.py " + " ".join(sys.argv[1:])
    if args.cluster:
        new_http = over_http(args, data, keyed(stored()))
        same = ("preset", "intervals", "workers", "rounds", "local_steps", "seed")
        with exclusive("compose"):
            old = {"sweeps": DEFAULT_SWEEPS, "test_bytes": args.bytes, "depth": [], **stored()}
            old["over_http"] = [
                r
                for r in old.get("over_http", [])
                if any(r.get(k, "forward") != new_http[k] for k in same)
            ] + [new_http]
            old["commands"] = with_command(old, command)
            write_json(RESULT, old)
            update_section("compose", markdown(old))
        print(markdown(old))
        return
    if args.clock:
        rows_now = list(clock(args))
        with exclusive("compose"):
            old = {"sweeps": DEFAULT_SWEEPS, "test_bytes": args.bytes, "depth": [], **stored()}
            names = {(r["preset"], r["method"]) for r in rows_now}
            old["clock"] = [
                r for r in old.get("clock", []) if (r["preset"], r["method"]) not in names
            ] + rows_now
            old["commands"] = with_command(old, command)
            write_json(RESULT, old)
            update_section("compose", markdown(old))
        print(markdown(stored()))
        return
    if args.simulate:  # each method's row saved as it comes, over the same method's of its seed
        one = ("preset", "method", "seed")
        for new in head_to_head(args, data):
            with exclusive("compose"):
                old = {"sweeps": DEFAULT_SWEEPS, "test_bytes": args.bytes, "depth": [], **stored()}
                old["head_to_head"] = [
                    r for r in old.get("head_to_head", []) if any(r.get(k) != new[k] for k in one)
                ] + [new]
                old["commands"] = with_command(old, command)
                write_json(RESULT, old)
                update_section("compose", markdown(old))
        print(markdown(stored()))
        return
    result = stored()
    for row in grid(args, data):
        by_seed = dict(keyed(stored()).get(row.key, {}).get("by_seed", {}))
        for seed in args.seeds:
            if str(seed) not in by_seed:
                by_seed[str(seed)] = measure(row, seed, args, data)
                print(f"{row.key} seed {seed}: {by_seed[str(seed)]['test_ce']:.4f}", flush=True)
        for seed, scored in by_seed.items():  # scored before eval reported the head exit
            run = WORK / f"{row.key}-seed{seed}"
            if row.model == "blocktrain" and "head_ce_per_block" not in scored and run.exists():
                seq_len = row.config(0, args.threads).model.seq_len
                test = load_split(data, "test").windows(seq_len, args.bytes)
                by_seed[seed] = {**scored, "head_ce_per_block": head_ces(run, test)}
        # Saved after every row (a stopped run keeps it), into the JSON as it is now: another
        # process of this bench may have added rows or seeds meanwhile. The lock is held for
        # the write only, not for the evaluations above.
        with exclusive("compose"):
            old = stored()
            by_key = keyed(old)
            by_seed = {**by_key.get(row.key, {}).get("by_seed", {}), **by_seed}
            by_key[row.key] = summarise(row, by_seed, row.config(0, args.threads), data)
            result = save(old, by_key, with_command(old, command), args)
    print(markdown(result))


def stored() -> dict[str, Any]:
    """The JSON as it is on disk now."""
    path = ROOT / "benchmarks" / "results" / RESULT
    return json.loads(path.read_text()) if path.exists() else {"rows": [], "commands": []}


def keyed(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The stored rows by their Row key."""
    fields = Row.__dataclass_fields__
    return {Row(**{k: r[k] for k in fields if k in r}).key: r for r in result["rows"]}


def with_command(result: dict[str, Any], command: str) -> list[str]:
    """The commands that made the JSON, COMMAND last."""
    return [c for c in result.get("commands", []) if c != command] + [command]


def save(
    old: dict[str, Any], by_key: dict[str, Any], commands: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    rows = sorted(
        by_key.values(),
        key=lambda r: (
            r["preset"],
            r["model"] != "blocktrain",
            r["blocks"],
            r["layers_per_block"],
            r["route"],
            r.get("upstream_every", 1),
            r.get("upstream_lag", 0),
            r.get("intervals", "forward"),
            r["steps"],
        ),
    )
    presets = sorted({r["preset"] for r in rows})
    result = {  # the other tables (head_to_head, over_http, clock) kept as they are
        **old,
        "machine": machine(),
        "sweeps": DEFAULT_SWEEPS,
        "test_bytes": args.bytes,
        "commands": commands,
        "rows": rows,
        "depth": [d for name in presets for d in depth_delivered(rows, name)],
    }
    write_json(RESULT, result)
    update_section("compose", markdown(result))
    return result


if __name__ == "__main__":
    main()
