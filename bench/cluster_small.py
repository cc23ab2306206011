"""The paper's shared-node run at the small shape: 6 workers (2 replicas per block)
and the aggregator, real HTTP on loopback, rounds of H local steps up to the 1,500 steps per
replica of the converged single-process run in benchmarks/results/quality.json (the same
preset, batch and learning-rate schedule: the schedule spans rounds x H), then the sampler CE
of the final model on the same test bytes as bench/quality.py (32,768 bytes, M = 64, seed
1234), against that run's. Writes benchmarks/results/cluster_small.json (cluster_sampler_ce,
single_sampler_ce, participation_mean, bytes_total) and the `cluster-small` section of
BENCHMARKS.md.

Resumable: it takes hours on 2 cores. Everything lives in --work (the aggregator's state
folder, the workers' tokens, logs, the model, the evaluation). Stop it with Ctrl-C (SIGINT or
SIGTERM: the workers and the aggregator are stopped cleanly) and run the same command again:
the aggregator resumes from its last committed versions (a round that was open restarts with
the updates it had accepted), and the workers register anew and pull the open round. What a
resume loses: the workers' AdamW moments (they live in the worker processes; they rebuild
within a few dozen steps) and the local steps of the round in progress. A finished run is only
evaluated; a finished evaluation is only reported.

    python bench/cluster_small.py                     # 150 rounds of H = 10: hours; resumable
    python bench/cluster_small.py --local-steps 25    # 60 rounds of 25
    python bench/cluster_small.py --preset tiny --rounds 4 --local-steps 2 --workers 3 \\
        --test-bytes 2048 --sweeps 2 --work runs/cs-smoke --out /tmp/cs.json \\
        --benchmarks /tmp/cs.md --set d_model=64                             # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from blocktrain.config import RunConfig, apply_overrides
from blocktrain.data import resolve_data_path
from blocktrain.errors import ProtocolError
from blocktrain.presets import preset
from blocktrain.protocol.core.participation import participation
from blocktrain.protocol.ops.cluster import run_cluster
from blocktrain.protocol.store.storage import StateDir
from blocktrain.training.local import write_assembled
from protocol_cluster import run as blocktrain  # bench/protocol_cluster.py
from quality import FULL  # bench/quality.py: the converged run's shape and test settings
from report import BENCHMARKS_MD, RESULTS, ROOT, cluster_state, machine, update_section

TEST_SEED = 1234
"""The noise seed of bench/quality.py's test-split figures (Bench.test_metrics)."""
INTERRUPTED = 130


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default=FULL.base, help="model preset (quality.json's: small)")
    p.add_argument("--workers", type=int, default=6, help="worker processes (2 per block: 6)")
    p.add_argument("--local-steps", type=int, default=10, help="H, local steps per round")
    runs = p.add_mutually_exclusive_group()
    runs.add_argument(
        "--steps", type=int, help=f"steps per replica (default {FULL.max_steps}); rounds = S / H"
    )
    runs.add_argument("--rounds", type=int, help="rounds per block (steps = R x H)")
    p.add_argument("--deadline", type=float, default=600.0, help="round deadline, seconds")
    p.add_argument("--test-bytes", type=int, default=FULL.test_bytes, help="test bytes")
    p.add_argument("--sweeps", type=int, default=FULL.sweeps, help="M of the test sampler CE")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="per invocation, seconds")
    p.add_argument("--work", default="runs/bench-cluster-small", help="state, logs and model")
    p.add_argument("--data", help="data path (default: $BLOCKTRAIN_DATA)")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="config overrides (a smoke run's smaller model); the run is then not comparable",
    )
    p.add_argument(
        "--effect-probe",
        choices=("on", "off"),
        default="off",
        help="the aggregator's effect probe (default off, as the committed run: the probe's "
        "rule then refused honest updates near the learning rate's peak; `blocktrain cluster` "
        "now runs it by default, BENCHMARKS.md); a resume must pass the same",
    )
    p.add_argument("--out", default=str(RESULTS / "cluster_small.json"), help="the JSON")
    p.add_argument("--benchmarks", default=str(BENCHMARKS_MD), help="the Markdown to update")
    args = p.parse_args()
    for name in ("workers", "local_steps", "steps", "rounds", "deadline", "test_bytes", "sweeps"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.rounds is None:
        steps = FULL.max_steps if args.steps is None else args.steps
        if steps % args.local_steps:
            p.error(f"--steps {steps} is not a multiple of --local-steps {args.local_steps}")
        args.rounds = steps // args.local_steps
    return args


def run_config(args: argparse.Namespace) -> RunConfig:
    """The preset with its learning-rate schedule spanning the run (round r: steps rH..rH+H-1),
    as `blocktrain cluster` does."""
    steps = args.rounds * args.local_steps
    return apply_overrides(preset(args.preset), [*args.overrides, f"steps={steps}"])


def open_run(args: argparse.Namespace, work: Path) -> tuple[StateDir, list[str], str]:
    """The run's state and tokens: created on the first invocation, read back after."""
    cfg = run_config(args)
    settings = {
        "deadline_s": args.deadline,
        "min_round_s": 0.0,  # a trusted run: a round closes as soon as its workers report
        "local_steps": args.local_steps,
        "n_workers": args.workers,
        "max_rounds": args.rounds,
        "effect_probe": args.effect_probe,
    }
    tokens_file = work / "tokens.json"
    if not (work / "state").exists():
        state, tokens, observer = cluster_state(work / "state", cfg, settings, args.workers)
        tokens_file.touch(mode=0o600)
        tokens_file.write_text(json.dumps({"workers": tokens, "observer": observer}))
        return state, tokens, observer
    state = StateDir(work / "state")
    if not state.initialised or not tokens_file.exists():
        fail(f"{work} holds no run of this bench: remove it or pass another --work")
    saved = state.settings()
    ours = (cfg.to_dict(), args.local_steps, args.rounds, args.workers, args.effect_probe)
    theirs = RunConfig.from_dict(state.run_config()).to_dict()  # keys added since: defaults
    saved_run = (theirs, saved.local_steps, saved.max_rounds, saved.n_workers, saved.effect_probe)
    if saved_run != ours:
        fail(
            f"{work} holds another run (preset, steps, H, rounds, workers or effect probe "
            "differ): run the command that started it to resume it, or pass another --work"
        )
    doc = json.loads(tokens_file.read_text())
    return state, list(doc["workers"]), str(doc["observer"])


def fail(message: str) -> NoReturn:
    print(f"cluster_small: {message}", file=sys.stderr)
    sys.exit(2)


def closed_rounds(state: StateDir) -> int:
    return min(state.ledger.block_state(b)[1] for b in range(state.n_blocks()))


def interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: run_cluster's finally stops every process


def train(args: argparse.Namespace, work: Path, data: str) -> None:
    """Run (or resume) the cluster until every block has closed its rounds."""
    state, tokens, observer = open_run(args, work)
    progress_file = work / "progress.json"
    progress = json.loads(progress_file.read_text()) if progress_file.exists() else []
    before = closed_rounds(state)
    if before >= args.rounds:
        state.close()
        return
    attempt = {"started_at_round": before, "wall_s": 0.0, "finished": False}
    print(f"cluster_small: rounds {before}/{args.rounds}, attempt {len(progress) + 1}", flush=True)
    t0 = time.monotonic()
    try:
        run_cluster(
            state,
            tokens,
            observer,
            work / "logs" / f"attempt-{len(progress) + 1}",  # earlier attempts' logs are kept
            data=data,
            timeout_s=args.timeout,
        )
        attempt["finished"] = True
    finally:
        attempt.update(wall_s=time.monotonic() - t0, ended_at_round=closed_rounds(state))
        progress_file.write_text(json.dumps([*progress, attempt], indent=2))
        state.close()


def evaluate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The final model's test-split figures (cached in the work folder)."""
    done = work / "eval.json"
    if done.exists():
        return dict(json.loads(done.read_text()))
    state = StateDir(work / "state")
    latest = {b: state.ledger.block_state(b)[0] for b in range(state.n_blocks())}
    blocks = {b: state.load_tensors(b, v) for b, v in latest.items()}
    state.close()
    write_assembled(work / "model", run_config(args), blocks, args.rounds * args.local_steps)
    argv = ["eval", str(work / "model"), "--split", "test", "--bytes", str(args.test_bytes),
            "--sweeps", str(args.sweeps), "--seed", str(TEST_SEED), "--json"]  # fmt: skip
    result = {"command": "blocktrain " + " ".join(argv), **blocktrain(argv)}
    done.write_text(json.dumps(result, indent=2))
    return result


SCHEDULE = ("steps", "batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1")
SCHEDULE += ("beta2", "grad_clip", "precision")


def summarise(args: argparse.Namespace, work: Path, final: dict[str, Any]) -> dict[str, Any]:
    state = StateDir(work / "state")
    rounds = state.ledger.rounds()
    traffic = [r for r in state.ledger.traffic() if r["endpoint"] != "status"]  # not protocol
    updates: dict[str, int] = {}  # "accepted", or the refusal's reason -> updates
    for r in state.ledger.updates():
        key = r.fate if r.fate == "accepted" else str(r.reason)
        updates[key] = updates.get(key, 0) + 1
    settings = state.settings()
    # The identities whose reputation moved, as the ledger holds it at the end (1: unmoved).
    reputation = {f"{kind}:{i}": score for (kind, i), score in state.ledger.reputations().items()}
    latest = [(b, state.ledger.block_state(b)[0]) for b in range(state.n_blocks())]
    params = [sum(t.numel() for t in state.load_tensors(*bv).values()) for bv in latest]
    state.close()
    closes: dict[int, float] = {}  # round -> when its last block closed it
    for r in rounds:
        closes[r["round"]] = max(closes.get(r["round"], 0.0), r["closed_at"])
    gaps = [b - a for a, b in itertools.pairwise(closes[k] for k in sorted(closes))]
    per_block: dict[str, list[float]] = {}
    for r in rounds:
        per_block.setdefault(str(r["block"]), []).append(participation(r["in_time"], r["expected"]))
    quality = json.loads((RESULTS / "quality.json").read_text())["converged"]
    # Through RunConfig, so that keys added since quality.json was written take their defaults.
    ours, theirs = run_config(args).to_dict(), RunConfig.from_dict(quality["config"]).to_dict()
    comparable = (
        ours["model"] == theirs["model"]
        and ours["seed"] == theirs["seed"]
        and all(ours["train"][k] == theirs["train"][k] for k in SCHEDULE)
        and (args.test_bytes, args.sweeps) == (FULL.test_bytes, quality["blocktrain"]["sweeps"])
    )
    progress = json.loads((work / "progress.json").read_text())
    return {
        "command": "python bench/cluster_small.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "workers": args.workers,
        "replicas_per_block": args.workers // ours["model"]["blocks"],
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "steps_per_replica": args.rounds * args.local_steps,
        "deadline_s": settings.deadline_s,
        "delta_wire": settings.push_wire,
        "effect_probe": settings.effect_probe,
        "updates": updates,
        "reputation_final": reputation,
        "cluster_sampler_ce": final["sampler_ce"],
        "single_sampler_ce": quality["blocktrain_sampler_ce"],
        "gap": final["sampler_ce"] - quality["blocktrain_sampler_ce"],
        "comparable": comparable,
        "single_steps": quality["steps"]["blocktrain"],
        "participation_mean": sum(map(sum, per_block.values()))
        / max(1, sum(map(len, per_block.values()))),
        "participation_mean_per_block": {b: sum(v) / len(v) for b, v in per_block.items()},
        "params_per_block": params,
        "bytes_total": sum(r["bytes_in"] + r["bytes_out"] for r in traffic),
        "bytes_up": sum(r["bytes_in"] for r in traffic),
        "bytes_down": sum(r["bytes_out"] for r in traffic),
        "seconds_per_round_median": statistics.median(gaps) if gaps else None,
        "attempts": progress,
        "wall_s": sum(a["wall_s"] for a in progress),
        "final": final,
        "machine": machine(),
    }


def unrecorded(attempts: list[dict[str, Any]]) -> str:
    """What the recorded invocations leave out: rounds run by one killed before it could
    record itself (SIGKILL, or the machine going away)."""
    first = attempts[0]["started_at_round"] if attempts else 0
    if not first:
        return ""
    return (
        f" (rounds {first} on; rounds 0-{first - 1} ran in an invocation killed before it "
        "recorded itself)"
    )


def markdown(r: dict[str, Any]) -> str:
    f = r["final"]
    attempts = r["attempts"]
    part = ", ".join(f"{v:.3f}" for v in r["participation_mean_per_block"].values())
    moved = r.get("reputation_final", {})
    reputation = ", ".join(f"{k} {v:.3g}" for k, v in moved.items()) or "every identity at 1"
    caveat = (
        ""
        if r["comparable"]
        else "\n**Not comparable**: this run's preset, schedule or test settings differ from the "
        "converged run of quality.json.\n"
    )
    return f"""
### The shared-node run at the small shape: 6 workers over HTTP against single-process training

`{r["command"]}` (resumable; JSON: `benchmarks/results/cluster_small.json`). {r["workers"]} worker
processes and the aggregator on this machine, real HTTP on loopback, {r["replicas_per_block"]} replicas
per block, preset {r["preset"]}; {r["rounds"]} rounds of H = {r["local_steps"]} local AdamW steps =
{r["steps_per_replica"]} steps per replica, the learning-rate schedule spanning the run as in the
converged single-process run of `benchmarks/results/quality.json` ({r["single_steps"]} steps per
block, the same preset, batch and schedule). Wire {r["delta_wire"]}, round deadline {r["deadline_s"]:g} s.
{len(attempts)} recorded invocation(s), {r["wall_s"] / 3600:.2f} h of wall clock in all{unrecorded(attempts)}, a
round every {r["seconds_per_round_median"] or 0:.0f} s (median).
{caveat}
Sampler CE on the test split ({f["bytes"]:,} scored bytes, M = {f["sweeps"]}, seed {TEST_SEED}: the bytes and
noise of quality.json's figure):

| run | steps per block replica | sampler CE | from-noise CE |
|---|---:|---:|---:|
| cluster, {r["workers"]} workers over HTTP | {r["steps_per_replica"]} | **{r["cluster_sampler_ce"]:.4f}** | {f["from_noise_ce"]:.4f} |
| single process (quality.json, converged) | {r["single_steps"]} | **{r["single_sampler_ce"]:.4f}** | |

Gap {r["gap"]:+.4f}, cluster minus single (goal: within 0.02, bar: within 0.05). The aggregator's effect probe:
{r["effect_probe"]}; updates by fate: {", ".join(f"{k} {v}" for k, v in r["updates"].items())};
reputation at the end: {reputation}.
Participation (accepted in time over
expected, mean per block): {part}; overall {r["participation_mean"]:.3f}. Bytes moved (HTTP bodies,
status polls excluded): {r["bytes_total"] / 1e9:.2f} GB ({r["bytes_down"] / 1e9:.2f} GB down,
{r["bytes_up"] / 1e9:.2f} GB up).
"""


def main() -> int:
    args = parse_args()
    data = str(resolve_data_path(args.data))
    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        train(args, work, data)
    except KeyboardInterrupt:
        print(
            f"cluster_small: interrupted; run the same command again to resume ({work})",
            file=sys.stderr,
        )
        return INTERRUPTED
    except ProtocolError as exc:  # e.g. every worker died: the logs say why
        print(f"cluster_small: {exc}; the same command resumes ({work})", file=sys.stderr)
        return 1
    final = evaluate(args, work)
    result = summarise(args, work, final)
    path = Path(args.out)
    path.write_text(json.dumps(result, indent=2) + "\n")
    update_section("cluster-small", markdown(result), Path(args.benchmarks))
    print(
        f"cluster_small: sampler CE {result['cluster_sampler_ce']:.4f} against "
        f"{result['single_sampler_ce']:.4f} single-process; participation "
        f"{result['participation_mean']:.3f}; {result['bytes_total'] / 1e9:.2f} GB; wrote {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
