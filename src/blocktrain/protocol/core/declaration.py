"""How one aggregator setting is declared: `Setting` (its doc, check, flag, whether the
simulator models it), `setting` (the dataclass field that carries it), and the checks several
settings share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """What a field declares besides its type and default."""

    doc: str
    check: Callable[[Any], bool]
    why: str
    """What `check` requires, completing "aggregator setting NAME = VALUE ..."."""
    flag: str | None = None
    """The setting's own flag, for the few a user picks on a normal run; every setting is also
    `--set NAME=VALUE` (cli.common.add_setting_args)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    simulated: bool = True
    """False: the simulator sets it itself or it means nothing there (no flag there)."""
    default_text: str | None = None
    """How the default reads in --help and the docs, when the value alone would mislead."""


def setting(
    default: Any,
    doc: str,
    check: Callable[[Any], bool],
    why: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    simulated: bool = True,
    default_text: str | None = None,
) -> Any:
    meta = Setting(doc, check, why, flag, metavar, choices, simulated, default_text)
    return dataclasses.field(default=default, metadata={"setting": meta})


def positive(v: Any) -> bool:
    return bool(v > 0)


def positive_or_none(v: Any) -> bool:
    return v is None or bool(v > 0)
