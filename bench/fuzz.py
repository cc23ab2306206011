"""Fuzzing: schemathesis against the aggregator, a block host and the router, in this
process at the micro shape, with valid tokens (so that cases reach past authentication), no
token and wrong ones, generated (positive and negative) data and hand-made malformed safetensors
bodies (tests/fuzz/harness.py, the harness the default suite runs at ~120 cases per app).
Writes benchmarks/results/fuzz.json: per app the cases, the failures by check and by status,
the statuses seen and the seconds taken; and the `fuzz` table of BENCHMARKS.md. Exits 1 when
any case failed.

    python bench/fuzz.py                      # 2,000 cases per app, seed 0
    python bench/fuzz.py --cases 5000 --seed 7
    python bench/fuzz.py --report             # the table again from the JSON, no run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from report import RESULTS, ROOT, machine, update_section, write_json  # bench/report.py

sys.path.insert(0, str(ROOT))  # the harness lives in tests/fuzz

from tests.fuzz.harness import fuzz, targets

APP_NAMES = {"aggregator": "aggregator", "host": "block host", "router": "router"}


def markdown(data: dict) -> str:
    """The BENCHMARKS.md table of a fuzz.json."""
    lines = [
        f"`{data['command']}` (commit {data['machine']['commit']}):",
        "",
        "| app | cases | responses >= 500 | crashes | schema violations | seconds | statuses |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, app in data["apps"].items():
        by_check = app["failures_by_check"]
        server_errors = sum(n for status, n in app["failures_by_status"].items() if status >= "5")
        statuses = ", ".join(f"{status}: {n:,}" for status, n in sorted(app["statuses"].items()))
        lines.append(
            f"| {APP_NAMES.get(name, name)} | {app['cases']:,} | {server_errors} "
            f"| {by_check.get('crash', 0)} | {by_check.get('response_schema_conformance', 0)} "
            f"| {app['seconds']:.1f} | {statuses} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", type=int, default=2000, help="generated cases per app")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (same seed, same cases)")
    p.add_argument("--out", default="fuzz.json", help="file name under benchmarks/results")
    p.add_argument("--report", action="store_true", help="rewrite the table from the JSON, no run")
    args = p.parse_args()
    if args.report:
        update_section("fuzz", markdown(json.loads((RESULTS / args.out).read_text())))
        return 0
    if args.cases <= 0:
        p.error("--cases must be positive")
    t0 = time.perf_counter()
    apps = {}
    with tempfile.TemporaryDirectory() as tmp, targets(Path(tmp)) as served:
        for name, target in served.items():
            report = fuzz(target, args.cases, seed_value=args.seed, keep=10)
            apps[name] = report.to_json()
            print(
                f"{name}: {report.cases} cases, {apps[name]['failures']} failures, "
                f"{report.seconds:.1f}s, statuses {apps[name]['statuses']}",
                flush=True,
            )
    failures = sum(a["failures"] for a in apps.values())
    data = {
        "command": f"python bench/fuzz.py --cases {args.cases} --seed {args.seed}",
        "cases_per_app": args.cases,
        "seed": args.seed,
        "checks": ["not_a_server_error", "response_schema_conformance", "crash"],
        "apps": apps,
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine(),
    }
    write_json(args.out, data)
    update_section("fuzz", markdown(data))
    print(f"wrote benchmarks/results/{args.out}: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
