"""tools/surface.py counts the CLI's flags and the settings fields as docs/rooms-metrics.md
measures them, and the benchmark-only switches stay out of the product's commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import surface  # tools/surface.py


def test_a_flag_is_an_option_once_help_and_positionals_excluded() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers()
    child = sub.add_parser("go", aliases=["g"])
    child.add_argument("--fast", action="store_true")
    nested = child.add_subparsers().add_parser("deep")
    nested.add_argument("-n", type=int)
    assert surface.flags_of(parser) == ["--verbose"]
    assert surface.walk(parser) == {"go": ["--fast"], "go deep": ["-n"]}


def test_the_counts_add_up_and_the_bench_switches_are_gone() -> None:
    result = surface.measure()
    assert result["flags_total"] == sum(len(f) for f in result["flags"].values())
    assert result["subcommands"] == 21 and result["parsers"] == 27
    assert {"ModelConfig", "TrainConfig", "RunConfig", "AggregatorSettings"} <= set(
        result["settings"]
    )
    assert set(result["serving_settings"]) == {"HostSettings", "RouterSettings"}
    flags = result["flags"]
    assert not {"--batch-rows", "--no-batching"} & set(flags["serve-block"])
    assert not {"--coalesce-sweeps", "--coalesce-window-ms"} & set(flags["serve"])
    assert "batch_rows" in result["serving_settings"]["HostSettings"]  # a setting still
