"""How much there is to read, as docs/rooms-metrics.md measures it: files, lines and the largest
module of each package under src/blocktrain/, the modules over 400 lines, and the lines of
BENCHMARKS.md. Lines are `str.splitlines()` counts (blank lines and docstrings included); the
top-level modules (`config.py`, `httpserve.py`, ...) form one row.

    python tools/size.py                # this checkout
    python tools/size.py --root DIR     # another checkout (e.g. a `git worktree` of an old commit)
    python tools/size.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MODULE_LIMIT = 400


def lines_of(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def measure(root: Path) -> dict[str, Any]:
    package_root = root / "src" / "blocktrain"
    packages: dict[str, dict[str, Any]] = {}
    modules: dict[str, int] = {}
    for path in sorted(package_root.rglob("*.py")):
        relative = path.relative_to(package_root)
        package = relative.parts[0] if len(relative.parts) > 1 else "(top-level modules)"
        count = lines_of(path)
        modules[f"blocktrain/{relative.as_posix()}"] = count
        row = packages.setdefault(package, {"files": 0, "lines": 0, "largest": "", "its_lines": 0})
        row["files"] += 1
        row["lines"] += count
        if count > row["its_lines"]:
            row["largest"], row["its_lines"] = f"blocktrain/{relative.as_posix()}", count
    benchmarks = root / "BENCHMARKS.md"
    return {
        "packages": dict(sorted(packages.items())),
        "files": sum(row["files"] for row in packages.values()),
        "lines": sum(modules.values()),
        "over_limit": {
            name: count
            for name, count in sorted(modules.items(), key=lambda item: -item[1])
            if count > MODULE_LIMIT
        },
        "benchmarks_md_lines": lines_of(benchmarks) if benchmarks.exists() else None,
    }


def print_tables(result: dict[str, Any]) -> None:
    print("| package | files | lines | largest module | its lines |")
    print("|---|---:|---:|---|---:|")
    for name, row in result["packages"].items():
        print(
            f"| {name} | {row['files']} | {row['lines']} | {row['largest']} | {row['its_lines']} |"
        )
    print(f"| all | {result['files']} | {result['lines']} | | |")
    over = result["over_limit"]
    listed = ", ".join(f"{name} {count}" for name, count in over.items()) or "none"
    print(f"\nModules over {MODULE_LIMIT} lines ({len(over)}): {listed}")
    print(f"BENCHMARKS.md: {result['benchmarks_md_lines']} lines")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not (args.root / "src" / "blocktrain").is_dir():
        parser.error(f"--root {args.root}: no src/blocktrain/ there")
    result = measure(args.root)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
