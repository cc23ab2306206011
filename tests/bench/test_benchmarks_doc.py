"""BENCHMARKS.md and docs/research/ (issue 57): BENCHMARKS.md stays under its bar and opens with
a summary whose links land on its sections; every section a bench renders lives in one file
only; the sections moved to docs/research/ are the ones their JSON renders; and the links of
README.md and docs/ to docs/research/ and to BENCHMARKS.md's sections resolve."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fuzz
import protocol_load_md
import quality
import quality_pair
import quality_probe
import relay_probe
from report import BENCHMARKS_MD, RESEARCH, RESULTS

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(RESEARCH.glob("*.md"))
MARKER = re.compile(r"^<!-- ([\w-]+):(begin|end) -->$", re.M)


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def section(path: Path, name: str) -> str:
    text = path.read_text()
    return text.split(f"<!-- {name}:begin -->\n", 1)[1].split(f"\n<!-- {name}:end -->")[0]


def test_benchmarks_md_is_under_its_bar() -> None:
    assert len(BENCHMARKS_MD.read_text().splitlines()) <= 1200


def test_the_summary_opens_the_file_and_every_row_links_to_a_section_with_a_date() -> None:
    text = BENCHMARKS_MD.read_text()
    assert text.index("## Summary") < text.index("\n## ", text.index("## Summary") + 1)
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in summary.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert len(rows) >= 15
    heads = anchors(text)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 5, row
        assert "`" in cells[2], f"no command: {row}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[3]), f"no date: {row}"
        target = re.fullmatch(r"\[.+\]\(#([\w-]+)\)", cells[4])
        assert target and target.group(1) in heads, f"no such section: {row}"


def test_every_rendered_section_is_whole_and_in_one_file_only() -> None:
    where: dict[str, Path] = {}
    for path in [BENCHMARKS_MD, *DOCS]:
        marks = MARKER.findall(path.read_text())
        names = [n for n, kind in marks if kind == "begin"]
        assert [n for n, kind in marks if kind == "end"] == names, path
        for name in names:
            assert name not in where, f"{name} in {where.get(name)} and {path}"
            where[name] = path


def moved() -> list[tuple[str, Path, Callable[[], str]]]:
    """The sections bench scripts render into docs/research/, each with its render from the JSON."""

    def read(name: str) -> dict[str, Any]:
        return dict(json.loads((RESULTS / name).read_text()))

    return [
        (
            "quality-quick",
            quality.SECTION_MD["-quick"],
            lambda: quality.tables(quality.measured("-quick")),
        ),
        (
            "quality-probe",
            quality_probe.SECTION_MD,
            lambda: quality_probe.table(read("quality_probe.json")),
        ),
        (
            "pair-small",
            quality_pair.SECTION_MD,
            lambda: quality_pair.markdown("small", read("pair_small.json")),
        ),
        (
            "relay-probe",
            relay_probe.SECTION_MD,
            lambda: relay_probe.markdown(read("relay_probe.json")),
        ),
        ("protocol-profile", RESEARCH / "decentralised.md", protocol_load_md.profile_text),
    ]


@pytest.mark.parametrize("name,path,render", moved(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_section_moved_to_docs_research_is_the_one_its_json_renders(
    name: str, path: Path, render: Callable[[], str]
) -> None:
    assert path.parent == RESEARCH
    assert section(path, name) == render().strip()


def test_the_aggregator_under_load_section_is_the_one_its_json_renders() -> None:
    result = json.loads((RESULTS / "protocol_load.json").read_text())
    assert section(BENCHMARKS_MD, "protocol-load") == protocol_load_md.section(result).strip()


def test_the_fuzzing_table_is_the_one_its_json_renders() -> None:
    result = json.loads((RESULTS / "fuzz.json").read_text())
    assert section(BENCHMARKS_MD, "fuzz") == fuzz.markdown(result).strip()


def test_links_to_docs_research_and_to_benchmarks_sections_resolve() -> None:
    """Markdown links from README.md, BENCHMARKS.md and docs/ to docs/research/ files and to
    BENCHMARKS.md#anchor; and every `BENCHMARKS.md, "Title"` that names a section by its title
    in quotes names one that is there."""
    bench_heads = anchors(BENCHMARKS_MD.read_text())
    sources = [ROOT / "README.md", BENCHMARKS_MD, *sorted((ROOT / "docs").rglob("*.md"))]
    for src in sources:
        text = src.read_text()
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[\w-]+)?\)", text):
            if "://" not in target:
                assert (src.parent / target).exists(), f"{src}: {target}"
        for page, hash_ in re.findall(r"\]\(([^)#\s]*BENCHMARKS\.md)?#([\w-]+)\)", text):
            if page or src == BENCHMARKS_MD:
                assert hash_ in bench_heads, f"{src}: #{hash_}"
        flat = re.sub(r"\s*\n\s*", " ", text)
        for title in re.findall(r'BENCHMARKS\.md,? (?:section )?"([^"]+)"', flat):
            assert any(h.startswith(anchor(title)) for h in bench_heads), f"{src}: {title!r}"
