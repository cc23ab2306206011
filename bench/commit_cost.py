"""What the aggregator's engine spends on one update and on one round's commit, by revision.

For each revision (this checkout, and with `--baseline REV` that commit's src/ exported with
`git archive`), a fresh process at one torch thread builds a `RoundEngine` on one synthetic
block of `--params` parameters (the block of bench/protocol_load.py, the same settings),
registers N workers, and runs `--rounds` rounds: each worker's fp16 body through `inspect`
(parse, validate, the copy sketch), `judge`, `screen` and `record`, then the commit (`tick`: the
drift observation, timed apart, and the aggregation). No HTTP, no disk: the engine's own costs, side by side.
The replay screen remembers `replay_rounds` (8) rounds of sketches, so its cost grows over the
first rounds: the last round's judge + record is the steady state.

    python bench/commit_cost.py --baseline d351f86        # 100 and 333 votes, both revisions
    python bench/commit_cost.py --baseline dd3ddc7 --rounds 9   # the screen at 8 rounds kept
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from protocol_revisions import Revision, export, this_checkout  # beside this script
from report import RESEARCH, machine, update_section, write_json

BENCH = Path(__file__).resolve().parent

RUN = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from protocol_load import block
from blocktrain.protocol.core.bodies import encode
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.settings import AggregatorSettings
torch.set_num_threads(1)
n, params = {votes}, {params}
settings = AggregatorSettings(deadline_s=600.0, min_round_s=0.0, local_steps=1,
    max_delta_norm=1e6, max_tokens=1 << 20, keep_versions=2, n_workers=n,
    effect_probe="off", quorum=1.0)
weights = block(params)
engine = RoundEngine.fresh({{0: weights}}, settings, seed=0)
workers = [engine.register(0.0, 0, lambda _b, i=i: i, i).worker for i in range(n)]
pool = torch.randn(params + n * ({rounds} + 1), generator=torch.Generator().manual_seed(1)).half()
spent = {{"inspect_s": 0.0, "judge_record_s": [], "commit_s": [], "observe_s": []}}
observe = engine.drift.observe  # the commit's drift observation, timed apart


def timed_observe(*args, **kwargs):
    t0 = time.perf_counter()
    try:
        return observe(*args, **kwargs)
    finally:
        spent["observe_s"][-1] += time.perf_counter() - t0


engine.drift.observe = timed_observe
for r in range({rounds}):
    spent["judge_record_s"].append(0.0)
    spent["observe_s"].append(0.0)
    views = [engine.pull(w, 0, 1.0 + r).view for w in workers]
    for i, (w, view) in enumerate(zip(workers, views)):
        at, delta = i + n * r, {{}}
        for k, t in weights.items():
            delta[k] = pool[at : at + t.numel()].view(t.shape) * 1e-3
            at += t.numel()
        meta = {{"block": 0, "base_version": view.version, "round": view.round, "tokens": 4096}}
        body = encode(delta, meta, "fp16")
        t0 = time.perf_counter()
        checked = engine.finish(engine.inspect(0, body), w)
        t1 = time.perf_counter()
        verdict = engine.judge(w, 0, checked.meta, 1.0 + r)
        verdict = engine.screen(w, 0, checked) if verdict.accepted else verdict
        assert verdict.accepted, verdict
        engine.record(w, 0, verdict, 1.0 + r, checked=checked)
        t2 = time.perf_counter()
        spent["inspect_s"] += t1 - t0
        spent["judge_record_s"][-1] += t2 - t1
    t0 = time.perf_counter()
    (committed,) = engine.tick(1.0 + r)
    spent["commit_s"].append(time.perf_counter() - t0)
    assert committed.changed
print(json.dumps(spent))
"""


def measure(rev: Revision, votes: int, params: int, rounds: int) -> dict[str, Any]:
    code = RUN.format(bench=str(BENCH), votes=votes, params=params, rounds=rounds)
    env = {**os.environ, "PYTHONPATH": str(rev.src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    spent = json.loads(out.strip().splitlines()[-1])
    updates = rounds * votes
    judged = spent["judge_record_s"]
    return {
        "commit": rev.commit,
        "votes": votes,
        "params": params,
        "rounds": rounds,
        "inspect_ms_per_update": 1e3 * spent["inspect_s"] / updates,
        "judge_record_ms_per_update": 1e3 * sum(judged) / updates,
        "judge_record_ms_last_round": 1e3 * judged[-1] / votes,
        "commit_s": spent["commit_s"],
        "commit_s_mean": sum(spent["commit_s"]) / len(spent["commit_s"]),
        "observe_s": spent["observe_s"],
        "observe_s_mean": sum(spent["observe_s"]) / len(spent["observe_s"]),
    }


def section(result: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {r['commit']} | {r['votes']} | {r['inspect_ms_per_update']:.2f} ms | "
        f"{r['judge_record_ms_per_update']:.2f} ms | "
        f"{r['judge_record_ms_last_round']:.2f} ms | "
        f"{r['commit_s_mean']:.2f} s | {r['observe_s_mean']:.2f} s |"
        for r in result["rows"]
    )
    rounds = result["rows"][0]["rounds"]
    return f"""**The engine alone** (`python bench/commit_cost.py --baseline {result["baseline"]}{
        f" --rounds {rounds}" if rounds != 2 else ""
    }`,
`benchmarks/results/commit_cost.json`; {result["machine"]["cpu"]}, one torch thread, each
revision in a fresh process, interleaved): one block of {result["rows"][0]["params"]:,}
parameters, {rounds} rounds of N fp16 bodies through `inspect` (parse, validate, the copy
sketch), `judge`, `screen`, `record`, then each round's commit (the drift observation and the
aggregation), the mean over the rounds; the last round's judge + record screens against the
sketches of the rounds before it (8 at most: `replay_rounds`). Of the commit, the drift
observation's part (which the aggregator runs on a thread of its own, outside its lock) is timed
apart; the rest is the aggregation, under the lock.

| code | votes | inspect an update | judge + record an update | the last round's | commit a round | of which the drift observation |
|---|---:|---:|---:|---:|---:|---:|
{rows}
"""


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--baseline", metavar="REV", required=True, help="the commit to compare with")
    p.add_argument("--votes", default="100,333", help="workers of one round, comma-separated")
    p.add_argument("--params", type=int, default=1_048_576, help="parameters of the block")
    p.add_argument("--rounds", type=int, default=2, help="rounds of N updates and a commit each")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old, new = export(args.baseline, Path(tmp)), this_checkout()
        for votes in (int(v) for v in args.votes.split(",")):
            for rev in (old, new):
                rows.append(measure(rev, votes, args.params, args.rounds))
                print(json.dumps(rows[-1]), flush=True)
    result = {"baseline": old.commit, "commit": new.commit, "rows": rows, "machine": machine()}
    if args.no_write:
        return
    print(f"wrote {write_json('commit_cost.json', result)}")
    update_section("commit-cost", section(result), RESEARCH / "decentralised.md")


if __name__ == "__main__":
    main()
