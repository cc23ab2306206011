"""The aggregator code a run of `bench/protocol_load.py` uses: this checkout's, or a commit's
exported with `git archive` (`--baseline REV`), run side by side."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from report import ROOT  # bench/report.py, beside this script


@dataclass(frozen=True)
class Revision:
    """The aggregator code a run uses: the `src/` folder of this checkout or of an exported
    commit (the aggregator's PYTHONPATH, whatever the bench's own imports)."""

    commit: str
    src: Path

    def flags(self) -> set[str]:
        """The options its `blocktrain aggregator` takes (flags moved behind `--set` over time)."""
        text = (self.src / "blocktrain" / "cli" / "aggregator.py").read_text()
        return set(re.findall(r'"(--[a-z][a-z-]*)"', text))

    def settings_fields(self) -> set[str]:
        """The aggregator settings its code knows (a state folder naming any other is refused)."""
        code = (
            "import dataclasses; from blocktrain.protocol.core.settings import AggregatorSettings"
            " as S; print(' '.join(f.name for f in dataclasses.fields(S)))"
        )
        env = {**os.environ, "PYTHONPATH": str(self.src)}
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        return set(out.split())


@contextmanager
def python_path(src: Path) -> Iterator[None]:
    """The aggregator subprocesses started inside import blocktrain from `src`."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(src)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *argv], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def export(rev: str, into: Path) -> Revision:
    """`git archive REV src`, unpacked into `into`."""
    commit = git("rev-parse", "--short", rev)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return Revision(commit, into / "src")


def this_checkout() -> Revision:
    dirty = bool(git("status", "--porcelain", "--", "src"))
    return Revision(git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else ""), ROOT / "src")
