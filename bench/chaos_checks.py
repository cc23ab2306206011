"""What bench/chaos.py checks after its soak: the ledger's invariants, versions sampled during
the run, and the sampler CE of a state folder at a given round (tests/fuzz/test_chaos_checks.py
shows each check can fail)."""

from __future__ import annotations

import itertools
from typing import Any

from blocktrain.config import RunConfig
from blocktrain.data import load_split, resolve_data_path
from blocktrain.protocol.store.state import round_versions
from blocktrain.protocol.store.storage import StateDir
from blocktrain.training import EvalSettings, evaluate_blocktrain
from blocktrain.training.local import build_stack


def check_ledger(state: StateDir) -> dict[str, Any]:
    """The ledger's invariants: `consistent` when all hold, `versions_monotonic` for the
    versions alone, and the first problems found."""
    ledger = state.ledger
    problems: list[str] = []
    integrity = ledger._query("PRAGMA integrity_check")[0][0]
    if integrity != "ok":
        problems.append(f"integrity_check: {integrity}")
    monotonic = True
    for b in range(state.n_blocks()):
        version, open_round, _ = ledger.block_state(b)
        rounds = ledger.rounds(b)
        if [r["round"] for r in rounds] != list(range(len(rounds))) or open_round != len(rounds):
            problems.append(f"block {b}: rounds not contiguous up to the open round {open_round}")
        prev = 0
        for r in rounds:
            # a round closed with nothing accepted keeps the version; any other moves it on
            grew = r["new_version"] > prev or (r["new_version"] == prev and r["accepted"] == 0)
            if r["base_version"] != prev or not grew:
                monotonic = False
                problems.append(
                    f"block {b} round {r['round']}: {r['base_version']} -> {r['new_version']} "
                    f"after version {prev} ({r['accepted']} accepted)"
                )
            prev = r["new_version"]
        if version != prev:
            problems.append(f"block {b}: version {version}, last committed {prev}")
        by_round = {r["round"]: r for r in rounds}
        counted: dict[int, int] = {}
        for u in ledger.updates(block=b):
            if u.fate == "refused":
                if u.committed_version is not None:
                    problems.append(f"refused update {u.id} is in version {u.committed_version}")
                continue
            closed = by_round.get(u.counts_in) if u.counts_in is not None else None
            if u.committed_version is None:
                if u.counts_in != open_round:
                    problems.append(
                        f"accepted update {u.id} is in no version and not in the open round"
                    )
            elif closed is None or closed["new_version"] != u.committed_version:
                problems.append(
                    f"accepted update {u.id} is in version {u.committed_version}, "
                    f"not that of its round {u.counts_in}"
                )
            else:
                counted[closed["round"]] = counted.get(closed["round"], 0) + 1
        for r in rounds:
            if counted.get(r["round"], 0) != r["accepted"]:
                problems.append(
                    f"block {b} round {r['round']}: {r['accepted']} accepted per the round, "
                    f"{counted.get(r['round'], 0)} updates in its version"
                )
        for v in {0, *(r["new_version"] for r in rounds)}:
            state.load_tensors(b, v)  # every committed version is on disk and readable
    return {"consistent": not problems, "versions_monotonic": monotonic, "problems": problems[:20]}


def sampled_monotonic(samples: list[list[int]]) -> bool:
    """Versions per block read from /v1/status over time never go back."""
    return all(
        all(a <= b for a, b in zip(x, y, strict=True)) for x, y in itertools.pairwise(samples)
    )


def sampler_ce(
    state: StateDir, cfg: RunConfig, rounds: int, data: str | None, n_bytes: int, seeds: int
) -> list[float]:
    """The sampler CE (M = 4) of the blocks after `rounds` rounds, once per evaluation seed."""
    chosen = round_versions(state, rounds)[-1]
    stack = build_stack(cfg, {b: state.load_tensors(b, v) for b, v in chosen.items()})
    windows = load_split(resolve_data_path(data), "valid").windows(cfg.model.seq_len, n_bytes)
    return [
        evaluate_blocktrain(stack, windows, EvalSettings(sweeps=4, seed=s, oracle=False))[
            "sampler_ce"
        ]
        for s in range(seeds)
    ]
