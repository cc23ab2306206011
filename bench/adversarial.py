"""Poisoning: hostile workers against the simulator's aggregator, with the defences on and off
side by side. Writes benchmarks/results/adversarial.json and the "adversarial" section
of BENCHMARKS.md.

Each row is one `blocktrain.simulate` run (the protocol's own RoundEngine, real local training,
a virtual clock) of 6 honest workers at the tiny preset (or `--preset`; 2 replicas per block,
regime lockstep, the same seed and H everywhere) plus the attackers of the row, every forged
or crafted delta at the norm bound in force and claiming the largest token count the aggregator
accepts; each row is read against the clean row of its preset, defences and rounds:

    clean           no attacker
    shrink          one attacker: -s x the block's weights (s up to 1.76, which leaves -0.76 x
                    the weights)
    bias            one attacker: one coordinate at the bound
    noise           one attacker: Gaussian noise at the bound
    sybils          4 attackers under ONE token, shrinking
    four_tokens     4 attackers under 4 tokens (against the block's 2 honest workers), shrinking
    majority        3 attackers under 3 tokens (a majority of the block's 5), shrinking
    poison_repeat   one attacker training honestly on one repeated byte
    poison_shuffle  one attacker training honestly on the training bytes shuffled
    poison_foreign  one attacker training honestly on the training text in Cyrillic letters
    drift           one attacker: 0.9 x its honest delta plus the largest bias on byte 0's logit
                    its copy of the effect probe passes, every round
    drift_four      4 attackers under 4 tokens, drifting
    ascend          one attacker: overfits the probe's windows, ascends the training loss
                    across the probe's gradient, at the bound
    copy            one attacker: an exact copy of an honest worker's delta of the same round
    replay          one attacker: an honest delta accepted in an earlier round, re-pushed

all on the last block (TARGET, the one the final CE hangs on; `blocktrain.simulate.attacks`
describes each kind), over `--rounds` rounds, or MIN_ROUNDS for the drift rows (the clean
rows of each length run with them),

under `default` (the aggregator's defaults: one vote per identity, clipping, tight bound, effect
probe, replay screen, influence bound, drift tracking) and `none` (the old aggregator: mean
weighted by claimed tokens, no clipping, the loose bound 4 x lr x H x sqrt(params), no probe,
no replay screen, no influence bound, no drift tracking); `no_drift` (the defaults without drift
tracking) only when --only names it. final_ce is
the final model's sampler CE (M = 16 sweeps on 16384 validation bytes), clean_ce the clean
row's under the same defences; target_drift the drift attackers' coordinate in the target
block's final weights (byte 0's logit bias less the mean of the other bytes'), clean_target_drift
the clean row's; attacker_pushes each attacker push's round, fate and what its trainer reported
of it (ascend: the share of the bound its ascent took, and the block's training loss on a
fresh batch before its delta, at the probe's step of it and after the whole of it).

    python bench/adversarial.py                 # 26 rows of 10 rounds and 6 of 20 (about
                                                # 1 min a default row of 10 rounds here, at
                                                # tiny; 2-5 min a none row)
    python bench/adversarial.py --only drift_four/no_drift
    python bench/adversarial.py --force         # re-run rows already in the JSON (those
                                                # --only names: not the clean rows it adds)
    python bench/adversarial.py --only sybils,clean/none   # some rows (several processes
                                                # may share the JSON: each saves under a lock)
    python bench/adversarial.py --force --rounds 20 --only clean/default
                                                # a clean row of another length: clean rows
                                                # run at --rounds (the drift rows add theirs)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from blocktrain.config import apply_overrides
from blocktrain.data import load_split
from blocktrain.presets import PRESETS, preset
from blocktrain.simulate import SimSpec, simulate
from blocktrain.simulate.attacks import Attack
from blocktrain.simulate.attacks.forge import BIAS_TENSOR
from blocktrain.simulate.regimes import load_regime
from defences import undefended  # bench/defences.py, beside it
from report import (  # bench/report.py
    RESULTS,
    add_simulated_row_args,
    exclusive,
    machine,
    update_section,
    write_json,
)

NAME = "adversarial.json"
TARGET = 2
"""Every attacker goes for the last block (the lowest noise levels): the final sampler CE hangs
on it. In a clean 10-round run, replacing block 0 or 1 by -0.76x its weights moved the CE by
0.002, block 2 by 1.41."""
ATTACKS: dict[str, Attack | None] = {
    "clean": None,
    "shrink": Attack("shrink", block=TARGET),
    "bias": Attack("bias", block=TARGET),
    "noise": Attack("noise", block=TARGET),
    "sybils": Attack("shrink", 4, block=TARGET, shared_token=True),
    "four_tokens": Attack("shrink", 4, block=TARGET),
    "majority": Attack("shrink", 3, block=TARGET),
    "poison_repeat": Attack("poison_repeat", block=TARGET),
    "poison_shuffle": Attack("poison_shuffle", block=TARGET),
    "poison_foreign": Attack("poison_foreign", block=TARGET),
    "drift": Attack("drift", block=TARGET),
    "drift_four": Attack("drift", 4, block=TARGET),
    "ascend": Attack("ascend", block=TARGET),
    "copy": Attack("copy", block=TARGET),
    "replay": Attack("replay", block=TARGET),
}
DEFENCES = ("default", "none", "no_drift")
"""Every row runs under the first two; `no_drift` (the defaults without drift tracking) only
when --only names it: whether the tracker helps or hurts where it misjudges (drift_four)."""
SWEPT = DEFENCES[:2]
SCREENED = ("replay", "copy")
"""Refusals of the replay screen; an honest update refused with one is a false positive
(`honest_screened`, 0 in every row under issue 58's bar)."""
MIN_ROUNDS = {"drift": 20, "drift_four": 20}
"""Rows that run at least this many rounds whatever --rounds says: a drift that passes each
round's check needs rounds to add up."""


def rounds_of(attack: str, args: argparse.Namespace) -> int:
    return max(args.rounds, MIN_ROUNDS.get(attack, 0))


def target_drift(block: dict[str, torch.Tensor]) -> float:
    """The drift attackers' coordinate (byte 0's logit bias) less the mean of its tensor's
    other coordinates."""
    bias = block[BIAS_TENSOR].float().view(-1)
    return float(bias[0] - bias[1:].mean())


def run_row(attack: str, defences: str, rounds: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = apply_overrides(preset(args.preset), [f"steps={rounds * args.local_steps}"])
    protocol: dict[str, Any] = {"local_steps": args.local_steps}
    if defences == "none":
        protocol.update(undefended(cfg, args.local_steps))
    elif defences == "no_drift":
        protocol["drift_threshold"] = 0.0
    spec = SimSpec(
        cfg,
        workers=6,
        rounds=rounds,
        protocol=protocol,
        eval_every=rounds,  # the final model is what the table compares
        attack=ATTACKS[attack],
    )
    t0 = time.perf_counter()
    report, weights = simulate(spec, [load_regime("lockstep")], args.train, args.valid)
    wall = time.perf_counter() - t0
    r = report["regimes"]["lockstep"]
    attackers = [w for w in r["workers"] if w["attacker"]]
    refused: dict[str, int] = {}
    for w in attackers:
        for reason, n in w["refused"].items():
            refused[reason] = refused.get(reason, 0) + n
    honest_refused: dict[str, int] = {}
    for w in r["workers"]:
        if not w["attacker"]:
            for reason, n in w["refused"].items():
                honest_refused[reason] = honest_refused.get(reason, 0) + n
    held = sum(1 for rec in r["rounds"] for b in rec["blocks"] if b["held"])
    per_round = []  # every block's updates of the round, honest and hostile alike
    for rec in r["rounds"]:
        refused_now: dict[str, int] = {}
        for b in rec["blocks"]:
            for reason, n in b["refused"].items():
                refused_now[reason] = refused_now.get(reason, 0) + n
        per_round.append(
            {"accepted": sum(b["accepted"] for b in rec["blocks"]), "refused": refused_now}
        )
    return {
        "preset": args.preset,
        "attack": attack,
        "defences": defences,
        "final_ce": r["final_sampler_ce"],
        "clean_ce": None,  # filled in from the clean row
        "target_drift": target_drift(weights["lockstep"][TARGET]),
        "clean_target_drift": None,  # likewise
        "final_from_noise_ce": r["final_from_noise_ce"],
        "initial_ce": r["initial_ce"],
        "seed": report["seed"],
        "rounds": rounds,
        "local_steps": args.local_steps,
        "torch_threads": args.threads,  # CE moves with it in the last digits: compare like rows
        "attackers": len(attackers),
        "attacker_accepted": sum(w["accepted"] for w in attackers),
        "attacker_refused": refused,
        "attacker_pushes": [
            {"worker_id": w["worker_id"], **p} for w in attackers for p in w["pushes"]
        ],
        "honest_refused": honest_refused,
        "honest_screened": sum(honest_refused.get(reason, 0) for reason in SCREENED),
        "rounds_held": held,
        "per_round": per_round,
        "max_delta_norm": report["protocol"]["max_delta_norm"],
        "protocol": report["protocol"],
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_simulated_row_args(p)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="(default: tiny)")
    p.add_argument(
        "--only",
        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
        default=[],
        metavar="ROWS",
        help="only these rows: ATTACK (defences default and none) or ATTACK/DEFENCES (default, "
        "none, no_drift), comma-separated",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.train, args.valid = load_split(args.data, "train"), load_split(args.data, "valid")
    wanted = [(a, d) for a in ATTACKS for d in SWEPT]
    if args.only:
        unknown = [x for x in args.only if x.split("/")[0] not in ATTACKS]
        if unknown:
            p.error(f"--only: unknown attack {unknown[0]!r}; known: {', '.join(ATTACKS)}")
        unknown = [x for x in args.only if "/" in x and x.split("/", 1)[1] not in DEFENCES]
        if unknown:
            p.error(f"--only: unknown defences in {unknown[0]!r}; known: {', '.join(DEFENCES)}")
        every = [(a, d) for a in ATTACKS for d in DEFENCES]
        wanted = [
            (a, d) for a, d in every if (a in args.only and d in SWEPT) or f"{a}/{d}" in args.only
        ]
    runs = [(a, d, rounds_of(a, args)) for a, d in wanted]
    # the clean row of each length and defences first: every row is read against one
    runs = list(dict.fromkeys([("clean", d, r) for _, d, r in runs] + runs))
    for attack, defences, rounds in runs:
        key = (args.preset, attack, defences, rounds)
        with locked() as rows:
            old = rows.get(key)
        forced = args.force and (attack, defences) in wanted  # not the clean rows it adds
        if old is not None and not forced and old["local_steps"] == args.local_steps:
            continue
        print(
            f"adversarial: {args.preset} {attack} / {defences}, {rounds} rounds ...",
            file=sys.stderr,
            flush=True,
        )
        row = run_row(attack, defences, rounds, args)
        with locked() as rows:
            rows[key] = row
    with locked() as rows:
        print(markdown(result_of(rows)))


@contextlib.contextmanager
def locked() -> Iterator[dict[Key, dict[str, Any]]]:
    """The JSON's rows, under a lock; what the caller leaves in the dict is saved (with the
    BENCHMARKS.md section), so that several processes can share the bench."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / NAME
    with exclusive("adversarial"):
        result = json.loads(path.read_text()) if path.exists() else {"rows": []}
        rows = {key_of(r): r for r in result["rows"]}
        before = json.dumps(result["rows"], sort_keys=True)
        yield rows
        saved = result_of(rows)
        if json.dumps(saved["rows"], sort_keys=True) != before:
            write_json(NAME, saved)
            update_section("adversarial", markdown(saved))


Key = tuple[str, str, str, int]
"""A row's preset, attack, defences and rounds."""


def key_of(row: dict[str, Any]) -> Key:
    # rows from before --preset were measured at tiny, the only preset the bench then ran
    return row.get("preset", "tiny"), row["attack"], row["defences"], row["rounds"]


def result_of(rows: dict[Key, dict[str, Any]]) -> dict[str, Any]:
    ordered = [rows[k] for k in sorted(rows, key=order)]
    for r in ordered:
        r.setdefault("preset", "tiny")
        clean = rows.get((r["preset"], "clean", r["defences"], r["rounds"]))
        r["clean_ce"] = None if clean is None else clean["final_ce"]
        r["clean_target_drift"] = None if clean is None else clean.get("target_drift")
    return {"command": "python bench/adversarial.py", "machine": machine(), "rows": ordered}


def order(key: Key) -> tuple[bool, str, int, int, int]:
    preset, attack, defences, rounds = key
    return preset != "tiny", preset, rounds, list(ATTACKS).index(attack), DEFENCES.index(defences)


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    first = rows[0] if rows else {"local_steps": "?", "seed": "?"}
    lines = [
        f"`{result['command']}`; JSON: `benchmarks/results/{NAME}`. 6 honest workers (2 "
        f"replicas per block; `--preset small` for the other shape), regime lockstep, rounds "
        f"of H = {first['local_steps']}, seed {first['seed']}; final CE: the sampler CE (M = "
        "16, 16384 validation bytes), against the clean row of the same preset, defences and "
        "rounds. Forged and crafted deltas sit at the norm bound in force and claim the largest "
        "token count; byte-0 drift: the target block's head.bias[0] less the mean of the "
        "other bytes' (the drift rows' coordinate), clean row's in brackets.",
        "",
        "| preset | attack | defences | rounds | final CE | clean CE | final − clean | "
        "norm bound | attacker updates accepted | attacker refusals | honest refusals | "
        "honest refused replay or copy | rounds held | byte-0 drift |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        diff = "—" if r["clean_ce"] is None else f"{r['final_ce'] - r['clean_ce']:+.3f}"
        clean = "—" if r["clean_ce"] is None else f"{r['clean_ce']:.3f}"
        lines.append(
            f"| {r['preset']} | {r['attack']} | {r['defences']} | {r['rounds']} | "
            f"{r['final_ce']:.3f} | {clean} | {diff} | "
            f"{r['max_delta_norm']:.3g} | {r['attacker_accepted']} | "
            f"{_counts(r['attacker_refused'])} | {_counts(r['honest_refused'])} | "
            f"{_screened(r)} | {r['rounds_held']} | {_drift(r)} |"
        )
    clean_rows = [r for r in rows if r["attack"] == "clean" and r.get("per_round")]
    if clean_rows:
        lines += ["", "Updates per round of the clean rows (accepted / refused, all honest):", ""]
        lines += [
            f"- {r['preset']} {r['defences']}, {r['rounds']} rounds: {_per_round(r)}"
            for r in clean_rows
        ]
    return "\n".join(lines)


def _per_round(row: dict[str, Any]) -> str:
    return " ".join(f"{p['accepted']}/{sum(p['refused'].values())}" for p in row["per_round"])


def _screened(row: dict[str, Any]) -> str:
    """Rows from before honest_screened have none."""
    return "—" if row.get("honest_screened") is None else str(row["honest_screened"])


def _drift(row: dict[str, Any]) -> str:
    """Rows from before target_drift have none."""
    if row.get("target_drift") is None:
        return "—"
    clean = row.get("clean_target_drift")
    return f"{row['target_drift']:+.2f}" + ("" if clean is None else f" ({clean:+.2f})")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


if __name__ == "__main__":
    main()
