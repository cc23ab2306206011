"""Count the CLI's flags and the settings fields, as docs/rooms-metrics.md measures them.

- CLI flags: the parser of `blocktrain.cli.main.build_parser()` walked through every subparser
  (nested ones such as `token add` included); a flag is an action with option strings, `--help`
  excluded, aliases (`-v`/`--verbose`) counted once; positionals are not flags. The top-level
  parser's own flags (`--version`, `--verbose`) are shown as `(blocktrain)` and not counted in
  the total, as the BEFORE figures were taken.
- Settings fields: `dataclasses.fields` of `AggregatorSettings` and of the dataclasses defined in
  `config.py` (`ModelConfig`, `TrainConfig`, `RunConfig`). The serving settings behind the
  `serve-block` and `serve` flags (`HostSettings`, `RouterSettings`) are a separate line.

Each class is looked up where it lives now and where it lived before the rooms split, so the
tool runs on older commits too:

    PYTHONPATH=src python tools/surface.py          # per-parser table and totals
    PYTHONPATH=src python tools/surface.py --json   # the same as one JSON object
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
from typing import Any

# Where each settings class lives now, then where it lived at 3aa3ee6.
AGGREGATOR_SETTINGS = ("blocktrain.protocol.core.settings", "blocktrain.protocol.settings")
SERVING_SETTINGS = {
    "HostSettings": ("blocktrain.serving.host.host_settings", "blocktrain.serving.host"),
    "RouterSettings": ("blocktrain.serving.router.router_settings", "blocktrain.serving.router"),
}


def find_class(name: str, modules: tuple[str, ...]) -> type | None:
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = getattr(module, name, None)
        if isinstance(found, type):
            return found
    return None


def subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """Each subparser once (its aliases share one parser), in registration order."""
    out: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, child in action.choices.items():
                if id(child) not in seen:
                    seen.add(id(child))
                    out.append((name, child))
    return out


def flags_of(parser: argparse.ArgumentParser) -> list[str]:
    """The longest option string of each flag action, `--help` excluded."""
    names = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        names.append(max(action.option_strings, key=len))
    return names


def walk(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    for name, child in subparsers(parser):
        path = f"{prefix} {name}".strip()
        table[path] = flags_of(child)
        table.update(walk(child, path))
    return table


def fields_of(cls: type) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def settings() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(the counted settings, the serving settings), each class name -> its field names."""
    counted: dict[str, list[str]] = {}
    aggregator = find_class("AggregatorSettings", AGGREGATOR_SETTINGS)
    if aggregator is None:
        raise SystemExit(
            "surface: AggregatorSettings not found in " + ", ".join(AGGREGATOR_SETTINGS)
        )
    counted["AggregatorSettings"] = fields_of(aggregator)
    config = importlib.import_module("blocktrain.config")
    for name, obj in inspect.getmembers(config, inspect.isclass):
        if dataclasses.is_dataclass(obj) and obj.__module__ == config.__name__:
            counted[name] = fields_of(obj)
    serving: dict[str, list[str]] = {}
    for name, modules in SERVING_SETTINGS.items():
        cls = find_class(name, modules)
        if cls is not None and dataclasses.is_dataclass(cls):
            serving[name] = fields_of(cls)
    return counted, serving


def measure() -> dict[str, Any]:
    from blocktrain.cli.main import build_parser

    parser = build_parser()
    table = walk(parser)
    counted, serving = settings()
    return {
        "subcommands": len(subparsers(parser)),
        "parsers": len(table),
        "flags_total": sum(len(flags) for flags in table.values()),
        "flags": table,
        "top_level_flags": flags_of(parser),
        "settings_total": sum(len(names) for names in counted.values()),
        "settings": counted,
        "serving_settings_total": sum(len(names) for names in serving.values()),
        "serving_settings": serving,
    }


def print_table(result: dict[str, Any], names: bool) -> None:
    width = max(len(path) for path in result["flags"])
    print(f"{'parser':<{width}}  flags")
    for path, flags in sorted(result["flags"].items()):
        line = f"{path:<{width}}  {len(flags):>5}"
        print(line + ("  " + " ".join(flags) if names and flags else ""))
    top = result["top_level_flags"]
    print(f"{'(blocktrain)':<{width}}  {len(top):>5}  not counted: {' '.join(top)}")
    print(
        f"flags: {result['flags_total']} over {result['parsers']} parsers "
        f"({result['subcommands']} subcommands)"
    )
    for label, key in (("settings", "settings"), ("serving settings", "serving_settings")):
        parts = ", ".join(f"{name} {len(fields)}" for name, fields in result[key].items())
        print(f"{label} fields: {result[key + '_total']} ({parts})")
        if names:
            for name, fields in result[key].items():
                print(f"  {name}: {' '.join(fields)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--names", action="store_true", help="list each flag and field by name")
    args = parser.parse_args(argv)
    result = measure()
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print_table(result, args.names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
