"""Compressed deltas on the wire: the same run with every pushed delta in fp16, int8 (a scale
per row), per-tensor top-k and the chunked sparse codec (error feedback on each worker), and the
ablations that say which detail of the sparse codec buys what.
Writes benchmarks/results/compression.json and the "compression" section of BENCHMARKS.md.

Each row is one `blocktrain.simulate` run (the protocol's own RoundEngine with its defaults:
validation, norm bound, effect probe, one vote per identity; real local training; a virtual
clock) of 6 workers at the tiny preset (2 replicas per block), regime lockstep, the same seed,
rounds and H in every row; only `delta_wire` differs (and, in an ablation row, one setting the
row's `variant` names), and with it the pulls: fp16 whole versions for fp16, and for the lossy
codecs deltas in the aggregator's default `pull_wire` for the push codec
(`delta_wire.default_pulls`: twice the density for sparse; protocol/core/pulls.py): under exact
pulls (the default) each version's commit from the version before, with `exact_pulls=off` a
delta from the view each worker holds (every row measured before exact pulls existed is labelled
so: it is what that setting runs). final_sampler_ce: the final model's sampler CE (M = 16
sweeps, 16384 validation bytes); bytes_total: every pull and push body of the run (bytes_up:
the pushes alone).

Rows run under `--route` (default: the config's default, `relay`). Every row measured before
rows recorded their route ran under `features`, the default then: those are the main tables.
Rows of another route or another `--preset` are pairs, fp16 and a codec of the same preset,
route, length and seed, read against each other in their own table. Small rows run with the
effect probe off, as `blocktrain cluster` does (the probe refuses honest updates at small near
the learning rate's peak: docs/research/decentralised.md, The shared-node run).

    python bench/compression.py --rounds 30 --local-steps 30 --route features   # the main rows
    python bench/compression.py --rounds 30 --local-steps 30 --route features --ablations
    python bench/compression.py --rounds 30 --local-steps 30 --route features --seeds 1,2 \
        --wires fp16,sparse:0.03:2          # the spread over seeds
    python bench/compression.py --wires topk:0.01     # add a row (rows in the JSON are kept)
    python bench/compression.py --wires sparse:0.03:2 --variant pull_wire=full   # one ablation
    python bench/compression.py --wires fp16 --variant outer_lr=0.7,outer_momentum=0.9  # dense control
    python bench/compression.py --force               # re-run rows already in the JSON
    python bench/compression.py --preset small --rounds 20 --local-steps 20 --wires sparse:0.03:2 \
        --route features                    # the small pair of the table
    python bench/compression.py --preset small --rounds 20 --local-steps 20 --wires sparse:0.03:2 \
        --route relay --eval-every 5        # the pair under relay, the gap against rounds
    python bench/compression.py --preset small --rounds 30 --local-steps 30 --wires sparse:0.03:2 \
        --route relay --variant relay_bits=2 --eval-every 5   # and 2-bit streams
    python bench/compression.py --traffic --rounds 20 --local-steps 20   # bytes by kind, no training

`--traffic` counts what each kind of byte a run moves (pushes, pulls, relayed streams) for
fp16 and the sparse codec under every route at tiny and small: the simulator on its timing-only
path (the same messages and bodies, no training), 6 workers, lockstep. It writes the JSON's
`traffic` rows and their table.

A variant is `KEY=VALUE[,KEY=VALUE]`: aggregator settings (`outer_lr=0.7,outer_momentum=0.9`),
the streams' `relay_bits` or `relay_every` (as `--set` takes them; they act under relay only),
or `mean=dense`, which averages sparse votes as dense ones (a coordinate one of two replicas
sent moves by half its value) instead of per coordinate over the votes that carry it. It applies
to every wire `--wires` names, fp16 too (a dense control); plain fp16, the reference of every
row, runs whenever a row differs from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

import codec_trace  # bench/codec_trace.py
from blocktrain.config import ROUTES, ModelConfig, apply_overrides
from blocktrain.data import load_split
from blocktrain.errors import ConfigError
from blocktrain.presets import PRESETS, preset
from blocktrain.protocol.core import round_engine
from blocktrain.protocol.core.aggregation import Accumulator
from blocktrain.protocol.core.delta_wire import FULL, DeltaWire
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.simulate import SimSpec, simulate
from blocktrain.simulate.regimes import load_regime
from report import (
    RESEARCH,
    RESULTS,
    add_simulated_row_args,  # bench/report.py
    machine,
    update_section,
    write_json,
)

NAME = "compression.json"
RESEARCH_MD = RESEARCH / "compression.md"  # the readings in full, and the runs of other lengths
WIRES = ("fp16", "int8", "topk:0.03", "sparse:0.03:2")
ABLATIONS: tuple[tuple[str, str], ...] = (
    ("topk:0.03", ""),  # per-tensor top-k, fp16 values, int32 indices
    ("sparse:0.03:8", ""),  # chunked top-k, 8-bit values
    ("sparse:0.03:4", ""),
    ("sparse:0.03:2", ""),
    ("sparse:0.03:2", "mean=dense"),
    ("sparse:0.03:2:beta=0.95", ""),
    ("sparse:0.03:2:beta=0.999", ""),
    ("sparse:0.03:2", "pull_wire=full"),  # whole pulls
    ("sparse:0.03:2", "pull_wire=sparse:0.03:4"),  # pulls at the push density
    ("sparse:0.03:2", "exact_pulls=off"),  # each worker's delta from its view
    ("sparse:0.02:2", ""),
    ("sparse:0.01:2", ""),
)
"""(wire, variant) of each ablation row: one detail of sparse:0.03:2 (its default pulls
sparse:0.06:4, `delta_wire.default_pulls`) changed at a time."""
TARGETS = {"int8": ("bar", 0.01, 0.55), "topk": ("bar", 0.03, 0.10), "sparse": ("bar", 0.03, 0.10)}
"""What a codec must reach against fp16 of the same seed, on the mean over seeds: (name, CE
within, total bytes at most). The sparse codecs' goal is GOAL."""
GOAL = (0.01, 0.03)
MIN_SEEDS = 3
MAIN_PRESET = "tiny"
"""The preset of the main tables; a row of another preset is read against fp16 of its own
preset, length and seed."""
MAIN_ROUTE = "features"
"""The route of the main tables: every row measured before a row recorded its route ran under
`features`, the default until 22240f6; a row of another route is read against fp16 of its own
route, beside them."""
PRESET_SETTINGS: dict[str, dict[str, Any]] = {"small": {"effect_probe": "off"}}
"""Aggregator settings every row of a preset takes (`blocktrain cluster`'s at small)."""


STREAM_KEYS = ("relay_bits", "relay_every")
"""Variant keys that set the run's config (`--set`): how `route = relay` relays its streams."""


def variant_settings(variant: str) -> tuple[dict[str, Any], bool]:
    """(aggregator settings, dense mean?) of a variant `KEY=VALUE[,KEY=VALUE]` ('' is none);
    its STREAM_KEYS are `variant_overrides`'."""
    settings: dict[str, Any] = {}
    dense_mean = False
    for item in filter(None, (x.strip() for x in variant.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant {item!r}: expected KEY=VALUE")
        if key == "mean":
            if value != "dense":
                raise ValueError(f"variant {item!r}: mean takes only 'dense'")
            dense_mean = True
        elif key in AggregatorSettings.__dataclass_fields__:
            try:
                settings[key] = float(value)
            except ValueError:
                settings[key] = value  # a codec name: pull_wire=full
        elif key not in STREAM_KEYS:
            raise ValueError(
                f"variant {item!r}: {key!r} is no aggregator setting, nor one of {STREAM_KEYS}"
            )
    return settings, dense_mean


def variant_overrides(variant: str) -> list[str]:
    """The variant's run config overrides (`relay_bits=2`), as `--set` takes them."""
    items = (x.strip() for x in variant.split(","))
    return [x for x in items if x.partition("=")[0] in STREAM_KEYS]


@contextlib.contextmanager
def dense_mean_of_sparse(on: bool) -> Iterator[None]:
    """The ablation of the per-coordinate mean: the engine's accumulators average every vote
    as a dense one, whatever the wire."""
    if not on:
        yield
        return
    original = round_engine.accumulator
    round_engine.accumulator = lambda settings: Accumulator(settings, per_coordinate=False)
    try:
        yield
    finally:
        round_engine.accumulator = original


def run_row(wire: str, variant: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    # the run's seed draws the model's initial weights and each worker's batches
    cfg = apply_overrides(
        preset(args.preset),
        [
            f"steps={args.rounds * args.local_steps}",
            f"seed={seed}",
            f"route={args.route}",
            *variant_overrides(variant),
        ],
    )
    settings, dense_mean = variant_settings(variant)
    base = PRESET_SETTINGS.get(args.preset, {})
    spec = SimSpec(
        cfg,
        workers=6,
        rounds=args.rounds,
        protocol={"local_steps": args.local_steps, "delta_wire": wire, **base, **settings},
        seed=seed,
        eval_every=args.eval_every or args.rounds,  # the final model is what tables compare
    )
    t0 = time.perf_counter()
    with dense_mean_of_sparse(dense_mean), codec_trace.traced() as trace:
        report, _ = simulate(
            spec, [load_regime("lockstep")], args.train, args.valid, progress=progress
        )
    r = report["regimes"]["lockstep"]
    return {
        "preset": args.preset,
        "route": args.route,
        "settings": base,
        "wire": wire,
        "variant": variant,
        "design": design(wire, variant),
        "pull_wire": pull_wire(wire, variant),
        "final_sampler_ce": r["final_sampler_ce"],
        "bytes_total": r["bytes"]["up"] + r["bytes"]["down"],
        "bytes_up": r["bytes"]["up"],
        "bytes_down": r["bytes"]["down"],
        "final_from_noise_ce": r["final_from_noise_ce"],
        "initial_ce": r["initial_ce"],
        "accepted": r["updates"]["accepted"],
        "refused": r["updates"]["refused"],
        "seed": report["seed"],
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "workers": 6,
        "wall_s": time.perf_counter() - t0,
        # the assembled model's from-noise CE after each evaluated round: the gap against rounds
        "from_noise_by_round": [
            [x["round"], x["from_noise_ce"]] for x in r["rounds"] if x["from_noise_ce"] is not None
        ],
        # per tensor kind and push: the share of the update sent, the residual kept
        "codec_trace": trace.summary(),
    }


def progress(regime: str, closed: int, total: int) -> None:
    """A long row's rounds closed so far (every block's rounds), every tenth of the run."""
    if closed % max(1, total // 10) == 0:
        print(f"  {closed}/{total} rounds closed", file=sys.stderr, flush=True)


def design(wire: str, variant: str) -> str:
    """What a row sends and how the aggregator takes it, in words."""
    w = DeltaWire.parse(wire)
    if w.kind == "int8":
        text = "dense int8, a scale per row"
    elif w.kind == "topk":
        text = f"top-k {w.ratio:g} per tensor, fp16 values, int32 indices"
    elif w.sparse:
        text = (
            f"top-k {w.ratio:g} per {w.chunk}x{w.chunk} chunk, {w.bits}-bit values, "
            f"{w.index_bits}-bit indices, error feedback decay {w.beta:g}"
        )
    else:
        text = f"dense {w.kind}"
    settings, dense_mean = variant_settings(variant)
    if w.sparse:
        text += "; dense mean" if dense_mean else "; per-coordinate mean"
    if "pull_wire" in settings:
        text += f"; pulls {settings['pull_wire']}"
    if settings.get("exact_pulls") == "off" and pull_wire(wire, variant) != FULL:
        text += "; lossy pulls (from the view)"
    for item in variant_overrides(variant):
        key, _, value = item.partition("=")
        text += (
            f"; streams {value}-bit" if key == "relay_bits" else f"; one step in {value} relayed"
        )
    if settings.get("outer_momentum"):
        text += (
            f"; outer lr {settings.get('outer_lr', 1.0):g}, momentum {settings['outer_momentum']:g}"
        )
    return text


TRAFFIC_PRESETS = ("tiny", "small")
TRAFFIC_WIRES = ("fp16", "sparse:0.03:2")
TRAFFIC_STREAM_BITS = (4, 2)
"""The cheaper streams the traffic table adds under relay, with the sparse codec."""


def traffic_row(
    name: str, route: str, wire: str, rounds: int, local_steps: int, relay_bits: int = 8
) -> dict[str, Any]:
    """The bytes of one timing-only run (no training: the same messages and bodies) by kind."""
    cfg = apply_overrides(
        preset(name),
        [f"steps={rounds * local_steps}", f"route={route}", f"relay_bits={relay_bits}"],
    )
    protocol = {"local_steps": local_steps, "delta_wire": wire, **PRESET_SETTINGS.get(name, {})}
    spec = SimSpec(cfg, workers=6, rounds=rounds, protocol=protocol, timing_only=True)
    report, _ = simulate(spec, [load_regime("lockstep")], None, None)
    b = report["regimes"]["lockstep"]["bytes"]
    streams = b["stream_up"] + b["stream_down"]
    return {
        "preset": name,
        "route": route,
        "wire": wire,
        "pull_wire": pull_wire(wire),
        "relay_bits": relay_bits,
        "rounds": rounds,
        "local_steps": local_steps,
        "workers": 6,
        "bytes_pushed": b["up"] - b["stream_up"],
        "bytes_pulled": b["down"] - b["stream_down"],
        "bytes_streams": streams,
        "bytes_total": b["up"] + b["down"],
    }


def traffic_markdown(rows: list[dict[str, Any]]) -> str:
    """The traffic table: each row's kinds, and its total against fp16 of its preset and route."""
    if not rows:
        return ""
    first = rows[0]
    lines = [
        f"What the bytes are (`python bench/compression.py --traffic --rounds {first['rounds']} "
        f"--local-steps {first['local_steps']}`): the simulator's timing-only path, the same "
        f"messages and bodies without training, 6 workers, lockstep, {first['rounds']} rounds of "
        f"H = {first['local_steps']}. Pulls: the block's versions, and under `features` the "
        "upstream blocks' too; streams: the relayed streams, up and down (8-bit features unless the "
        "row says).",
        "",
        "| preset | route | wire | pushes | pulls | streams | total | ÷ fp16 | streams' share |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    fp16 = {(r["preset"], r["route"]): r["bytes_total"] for r in rows if r["wire"] == "fp16"}
    for r in rows:
        base = fp16.get((r["preset"], r["route"]))
        ratio = "—" if base is None else f"{r['bytes_total'] / base:.3f}"
        bits = r.get("relay_bits", 8)
        wire = r["wire"] if bits == 8 else f"{r['wire']}, {bits}-bit streams"
        lines.append(
            f"| {r['preset']} | {r['route']} | {wire} | {r['bytes_pushed'] / 1e6:.1f} MB | "
            f"{r['bytes_pulled'] / 1e6:.1f} MB | {r['bytes_streams'] / 1e6:.1f} MB | "
            f"{r['bytes_total'] / 1e6:.1f} MB | {ratio} | "
            f"{r['bytes_streams'] / r['bytes_total']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_simulated_row_args(p)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=MAIN_PRESET,
        help=f"the rows' shape (default: {MAIN_PRESET}, the main tables; another is a pair "
        "beside them)",
    )
    p.add_argument(
        "--route",
        choices=ROUTES,
        default=ModelConfig.route,
        help=f"the rows' route (default: {ModelConfig.route}, the default; the main tables "
        f"are {MAIN_ROUTE}'s)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also measure the from-noise CE every N rounds (the row's from_noise_by_round; "
        "default: the final round only)",
    )
    p.add_argument(
        "--wires",
        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
        default=list(WIRES),
        metavar="WIRES",
        help=f"comma-separated delta wires (default: {','.join(WIRES)})",
    )
    p.add_argument(
        "--variant",
        default="",
        help="a variant (KEY=VALUE[,KEY=VALUE], see above) for the --wires rows",
    )
    p.add_argument(
        "--ablations",
        action="store_true",
        help="also run the ablation rows (each changes one detail of sparse:0.03:2)",
    )
    p.add_argument(
        "--seeds",
        type=lambda text: [int(x) for x in text.split(",") if x.strip()],
        default=[0],
        metavar="SEEDS",
        help="comma-separated seeds; the table is seed 0's, the others give the spread of "
        "each wire's CE against fp16 of the same seed (default: 0)",
    )
    p.add_argument(
        "--traffic",
        action="store_true",
        help="only count the bytes by kind (no training) for fp16 and sparse:0.03:2 under "
        "every route at tiny and small, and under relay with 4- and 2-bit streams",
    )
    args = p.parse_args()
    path = RESULTS / NAME
    saved = json.loads(path.read_text()) if path.exists() else {}
    if args.traffic:
        traffic = [
            traffic_row(name, route, wire, args.rounds, args.local_steps, bits)
            for name in TRAFFIC_PRESETS
            for route in ROUTES
            for wire, bits in [(w, 8) for w in TRAFFIC_WIRES]
            + ([(TRAFFIC_WIRES[-1], b) for b in TRAFFIC_STREAM_BITS] if route == "relay" else [])
        ]
        write_json(NAME, {**saved, "traffic": traffic})
        update_section("compression-traffic", traffic_markdown(traffic))
        print(traffic_markdown(traffic))
        return
    runs = [(wire, args.variant) for wire in args.wires] + (
        list(ABLATIONS) if args.ablations else []
    )
    runs = list(dict.fromkeys(runs))
    for wire, variant in runs:
        try:
            settings, _ = variant_settings(variant)
            AggregatorSettings(delta_wire=wire, **settings)  # refused here, not after other rows
            apply_overrides(preset(args.preset), variant_overrides(variant))
        except (ValueError, ConfigError) as exc:
            p.error(str(exc))
    forced = set(runs) if args.force else set()  # --force re-runs the rows asked for only
    if any(run != ("fp16", "") for run in runs) and ("fp16", "") not in runs:
        runs.insert(0, ("fp16", ""))  # every row is read against fp16 of its seed
    torch.set_num_threads(args.threads)
    args.train, args.valid = load_split(args.data, "train"), load_split(args.data, "valid")
    rows = saved_rows(saved)
    for seed in args.seeds:
        for wire, variant in runs:
            key = (args.preset, wire, variant, seed, args.rounds, args.local_steps, args.route)
            old = rows.get(key)
            fresh = old is not None and old.get("pull_wire") == pull_wire(wire, variant)
            if fresh and (wire, variant) not in forced:
                continue
            label = f"{args.preset} {args.route} {wire}" + (f" [{variant}]" if variant else "")
            print(f"compression: {label}, seed {seed} ...", file=sys.stderr, flush=True)
            rows[key] = row = run_row(wire, variant, seed, args)
            print(
                f"compression: {label}, seed {seed}: CE {row['final_sampler_ce']:.4f}, "
                f"{row['bytes_total'] / 1e6:.1f} MB, {row['wall_s']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            result = result_of(rows)  # saved after every row: an interrupted run resumes
            write_json(NAME, {**result, "traffic": saved.get("traffic", [])})
            update_section("compression", markdown(result))
            update_section("compression-other", shorter_markdown(result), RESEARCH_MD)
            update_section(
                "compression-trace", codec_trace.markdown(list(rows.values())), RESEARCH_MD
            )
    print(markdown(result_of(rows)))


def pull_wire(wire: str, variant: str = "") -> str:
    """How the row's pulls travel: the variant's pull_wire, else the aggregator's default for
    this push codec."""
    settings, _ = variant_settings(variant)
    return AggregatorSettings(delta_wire=wire, pull_wire=settings.get("pull_wire")).pulls


Key = tuple[str, str, str, int, int, int, str]
"""A row's preset, wire, variant, seed, rounds, H and route."""


def key_of(row: dict[str, Any]) -> Key:
    return (
        row.get("preset", MAIN_PRESET),  # the rows measured before --preset existed are tiny
        row["wire"],
        row.get("variant", ""),
        row["seed"],
        row["rounds"],
        row["local_steps"],
        row.get("route", MAIN_ROUTE),
    )


ROW_LISTS = ("rows", "seed_rows", "other_rows", "preset_rows")
"""The lists of result_of that hold rows; every row is in exactly one."""


def saved_rows(result: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """The rows of a saved result_of, by key: what a new run resumes from and keeps."""
    return {key_of(r): r for name in ROW_LISTS for r in result.get(name, [])}


def result_of(rows: dict[Key, dict[str, Any]]) -> dict[str, Any]:
    """The tables compare runs of one length: the longest that has an fp16 row (rows of other
    lengths are kept under `other_rows`). `rows`: seed 0's, each against fp16 of seed 0;
    `seed_rows`: the other seeds'; `seeds`: per wire and variant, its CE minus fp16's of the
    same seed, for every seed run with both, and its verdict against the bar and the goal;
    `preset_rows`: the rows of other presets, each against fp16 of its preset, length and seed."""
    main = {k[1:6]: r for k, r in rows.items() if (k[0], k[6]) == (MAIN_PRESET, MAIN_ROUTE)}
    lengths = [(k[3] * k[4], k[3], k[4]) for k in main if k[0] == "fp16" and not k[1]]
    _, rounds, local_steps = max(lengths, default=(0, 0, 0))
    kept = {k[:3]: r for k, r in main.items() if (k[3], k[4]) == (rounds, local_steps)}
    other_rows = [r for k, r in main.items() if (k[3], k[4]) != (rounds, local_steps)]
    first = {key: r for key, r in kept.items() if key[2] == 0}
    ordered = sorted(
        first.values(),
        key=lambda r: (r.get("variant", "") != "", r["wire"] not in WIRES, -r["bytes_up"]),
    )
    base = first.get(("fp16", "", 0))
    for r in ordered:
        if base is None:
            r["ce_vs_fp16"] = r["bytes_vs_fp16"] = r["bytes_up_vs_fp16"] = None
            continue
        r["ce_vs_fp16"] = r["final_sampler_ce"] - base["final_sampler_ce"]
        r["bytes_vs_fp16"] = r["bytes_total"] / base["bytes_total"]
        r["bytes_up_vs_fp16"] = r["bytes_up"] / base["bytes_up"]
    seeds: dict[str, dict[str, Any]] = {}
    for (wire, variant, seed), r in sorted(kept.items(), key=lambda kv: kv[0][2]):
        fp16 = kept.get(("fp16", "", seed))
        if (wire, variant) == ("fp16", "") or fp16 is None:
            continue
        label = wire + (f" [{variant}]" if variant else "")
        entry = seeds.setdefault(
            label,
            {"wire": wire, "variant": variant, "seeds": [], "ce_vs_fp16": [], "bytes_vs_fp16": []},
        )
        entry["seeds"].append(seed)
        entry["ce_vs_fp16"].append(r["final_sampler_ce"] - fp16["final_sampler_ce"])
        entry["bytes_vs_fp16"].append(r["bytes_total"] / fp16["bytes_total"])
    for entry in seeds.values():
        ce = entry["ce_vs_fp16"]
        entry["ce_vs_fp16_mean"] = statistics.fmean(ce)
        entry["ce_vs_fp16_sd"] = statistics.stdev(ce) if len(ce) > 1 else None
        entry["ce_vs_fp16_se"] = (
            entry["ce_vs_fp16_sd"] / len(ce) ** 0.5 if entry["ce_vs_fp16_sd"] is not None else None
        )
        entry["bytes_vs_fp16_mean"] = statistics.fmean(entry["bytes_vs_fp16"])
        entry["verdict"] = verdict(entry)
    others = [r for key, r in sorted(kept.items(), key=lambda kv: kv[0][2]) if key[2] != 0]
    return {
        "command": (
            f"python bench/compression.py --rounds {rounds} --local-steps {local_steps} "
            f"--route {MAIN_ROUTE}"
        ),
        "machine": machine(),
        "rows": ordered,
        "seed_rows": others,
        "seeds": seeds,
        "other_rows": other_rows,
        "preset_rows": preset_rows(rows),
    }


def preset_rows(rows: dict[Key, dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of presets or routes other than the main tables', by preset, length, seed and
    route, fp16 first, each with its CE and bytes against fp16 of the same preset, length, seed
    and route (None without)."""
    out = []
    for key in sorted(k for k in rows if (k[0], k[6]) != (MAIN_PRESET, MAIN_ROUTE)):
        r = rows[key]
        fp16 = rows.get((key[0], "fp16", "", *key[3:]))
        r["ce_vs_fp16"] = None if fp16 is None else r["final_sampler_ce"] - fp16["final_sampler_ce"]
        r["bytes_vs_fp16"] = None if fp16 is None else r["bytes_total"] / fp16["bytes_total"]
        out.append(r)
    return sorted(out, key=lambda r: (key_of(r)[0], *key_of(r)[3:], r["wire"] != "fp16"))


def verdict(entry: dict[str, Any]) -> str:
    """The codec's bar (and the sparse codec's goal) on the mean over seeds, total bytes."""
    wire = DeltaWire.parse(entry["wire"])
    kind = wire.kind
    if kind not in TARGETS:
        return "—"
    if len(entry["seeds"]) < MIN_SEEDS:
        return f"needs {MIN_SEEDS} seeds"
    ce, ratio = entry["ce_vs_fp16_mean"], entry["bytes_vs_fp16_mean"]
    name, ce_max, bytes_max = TARGETS[kind]
    out = f"{name} (CE +{ce_max}, bytes ≤ {bytes_max}) " + (
        "met" if ce <= ce_max and ratio <= bytes_max else "not met"
    )
    if wire.selects:
        met = ce <= GOAL[0] and ratio <= GOAL[1]
        out += f"; goal (CE +{GOAL[0]}, bytes ≤ {GOAL[1]}) " + ("met" if met else "not met")
    return out


def against_fp16(r: dict[str, Any]) -> tuple[str, str, str]:
    """A row's cells for its CE and total bytes against fp16 ('—' without one) and its
    refusals."""
    ce = "—" if r["ce_vs_fp16"] is None else f"{r['ce_vs_fp16']:+.4f}"
    total = "—" if r["bytes_vs_fp16"] is None else f"{r['bytes_vs_fp16']:.3f}"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "none"
    return ce, total, refused


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    first = rows[0] if rows else {"rounds": "?", "local_steps": "?", "seed": "?"}
    lines = [
        f"`{result['command']}` (`--ablations` for the rows with a variant, `--seeds 1,2` for "
        f"the spread); JSON: `benchmarks/results/{NAME}`. 6 workers, preset tiny "
        f"(2 replicas per block), regime lockstep, {first['rounds']} rounds of H = "
        f"{first['local_steps']}, seed {first['seed']}, the aggregator's defaults; only the "
        "wire differs (and in a row with a variant, the one setting it names): pushes in the "
        "row's codec, pulls as fp16 whole versions (fp16) or as deltas in the pulls column's "
        "codec (the lossy codecs): each version's commit from the one before under exact pulls "
        "(the default), from the view each worker holds with `exact_pulls=off` (the rows "
        "measured before exact pulls existed). Final CE: the sampler CE (M = 16, 16384 "
        "validation bytes).",
        "",
        "| wire | pulls | variant | design | final CE | − fp16 | bytes total | ÷ fp16 | bytes pushed | "
        "÷ fp16 | accepted | refused |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ce, total, refused = against_fp16(r)
        up = "—" if r["bytes_up_vs_fp16"] is None else f"{r['bytes_up_vs_fp16']:.3f}"
        lines.append(
            f"| {r['wire']} | {r.get('pull_wire', 'full')} | {r.get('variant') or '—'} | {design(r['wire'], r.get('variant', ''))} "
            f"| {r['final_sampler_ce']:.4f} | {ce} | {r['bytes_total'] / 1e6:.1f} MB"
            f" | {total} | {r['bytes_up'] / 1e6:.1f} MB | {up} | {r['accepted']} | {refused} |"
        )
    spread = result.get("seeds", {})
    if spread:
        lines += [
            "",
            "Seeds: each wire's final CE minus fp16's of the same seed (the same rounds; a "
            "difference smaller than the spread between seeds is no difference), for the wires "
            "run on more than one seed or on another seed alone (a wire run on seed 0 alone is "
            "the table above; the JSON's `seeds` holds every verdict). The verdict "
            f"reads the mean over at least {MIN_SEEDS} seeds and the mean bytes ÷ fp16.",
            "",
            "| wire | seeds | CE − fp16, each seed | mean ± sd (± standard error) | "
            "bytes ÷ fp16, each seed | verdict |",
            "|---|---|---|---:|---|---|",
        ]
        for label, e in spread.items():
            if e["seeds"] == [0]:
                continue  # its row above says all one seed can
            each = ", ".join(f"{x:+.4f}" for x in e["ce_vs_fp16"])
            ratios = ", ".join(f"{x:.3f}" for x in e["bytes_vs_fp16"])
            seeds = ", ".join(str(x) for x in e["seeds"])
            sd = "—" if e["ce_vs_fp16_sd"] is None else f"{e['ce_vs_fp16_sd']:.4f}"
            se = "—" if e["ce_vs_fp16_se"] is None else f"{e['ce_vs_fp16_se']:.4f}"
            lines.append(
                f"| {label} | {seeds} | {each} | {e['ce_vs_fp16_mean']:+.4f} ± {sd} (± {se}) | "
                f"{ratios} | {e['verdict']} |"
            )
    pairs = result.get("preset_rows", [])
    if pairs:
        lines += [
            "",
            "Other shapes and routes (the tables above ran under `features`, the default then): "
            "6 workers, regime lockstep, each row against fp16 of the same preset, route, "
            "length and seed, with the settings the preset's rows take "
            f"(`--preset NAME`; {', '.join(f'{k}: {v}' for k, v in PRESET_SETTINGS.items())}).",
            "",
            "| preset | route | rounds x H | seed | wire | pulls | variant | final CE | − fp16 | "
            "bytes total | ÷ fp16 | accepted | refused |",
            "|---|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in pairs:
            ce, total, refused = against_fp16(r)
            lines.append(
                f"| {key_of(r)[0]} | {key_of(r)[6]} | {r['rounds']} x {r['local_steps']} | "
                f"{r['seed']} | "
                f"{r['wire']} | {r.get('pull_wire', 'full')} | {r.get('variant') or '—'} | "
                f"{r['final_sampler_ce']:.4f} | {ce} | {r['bytes_total'] / 1e6:.1f} MB | "
                f"{total} | {r['accepted']} | {refused} |"
            )
    return "\n".join(lines)


def shorter_markdown(result: dict[str, Any]) -> str:
    """The runs of other lengths (kept, not compared): docs/research/compression.md's table."""
    shorter = sorted(
        result.get("other_rows", []), key=lambda r: (r["rounds"], r["local_steps"], r["seed"])
    )
    lines = [
        "Runs of other lengths (`bench/compression.py`, kept in compression.json's "
        "`other_rows`, not compared with BENCHMARKS.md's tables):",
        "",
        "| rounds x H | wire | variant | seed | final CE | bytes total |",
        "|---|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['rounds']} x {r['local_steps']} | {r['wire']} | {r.get('variant') or '—'} | "
        f"{r['seed']} | {r['final_sampler_ce']:.4f} | {r['bytes_total'] / 1e6:.1f} MB |"
        for r in shorter
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
