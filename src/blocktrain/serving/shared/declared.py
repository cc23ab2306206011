"""What the serving settings declare to the CLI, derived from their dataclasses (`HostSettings`,
`RouterSettings`): each field's doc is its attribute docstring, its flag the settings module's
`FLAGS` entry; a field without one is `--set NAME=VALUE` on its command (`cli.common.split_sets`).
`settings_table` is the table of docs/serving.md, Settings (a test holds the two equal)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring, on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, after in itertools.pairwise(body):
        named = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[stmt.target.id] = " ".join(str(after.value.value).split())
    return docs


def set_keys(cls: type, flags: dict[str, str]) -> tuple[str, ...]:
    """The fields `--set` takes: those without a flag of their own."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in flags)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        if f.default_factory is dataclasses.MISSING:
            return "required"
        return str(f.default_factory())
    return "none" if f.default is None or f.default == frozenset() else str(f.default)


def settings_table(commands: list[tuple[str, type, dict[str, str]]]) -> str:
    """The markdown table of every field of each (command, settings class, its FLAGS)."""
    rows = ["| setting | command | flag | default | meaning |", "|---|---|---|---|---|"]
    for command, cls, flags in commands:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = f"`{flags[f.name]}`" if f.name in flags else "--set only"
            meaning = docs[f.name].replace("|", "\\|")
            rows.append(f"| `{f.name}` | {command} | {flag} | {_default(f)} | {meaning} |")
    return "\n".join(rows)
