"""Which files of a corpus folder are read: the ``--glob`` patterns (README.md, "Your own corpus")
and their translation to regular expressions. Hidden files and folders are never read, whatever
the patterns."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from blocktrain.errors import DataError


@dataclass(frozen=True)
class FilePatterns:
    """Files that match an ``include`` pattern (all, when there is none) and no ``exclude`` pattern.
    Globs on the path relative to the folder: one without ``/`` matches a name at any depth, one
    with ``/`` the whole path (a leading ``/`` the same); ``*`` and ``?`` stay within a name, ``**``
    spans folders, ``[abc]`` is a set, and a trailing ``/`` means everything under a folder."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    _compiled: tuple[tuple[re.Pattern[str], ...], tuple[re.Pattern[str], ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for pattern in (*self.include, *self.exclude):
            if not pattern.strip():
                raise DataError(
                    "--glob takes a non-empty glob pattern, e.g. '*.txt' or '!build/**'"
                )
        compiled = (
            tuple(_glob_regex(p) for p in self.include),
            tuple(_glob_regex(p) for p in self.exclude),
        )
        object.__setattr__(self, "_compiled", compiled)

    def __bool__(self) -> bool:
        return bool(self.include or self.exclude)

    def selects(self, relative: str) -> bool:
        """Whether the file at `relative` (a POSIX path from the folder) is read."""
        include, exclude = self._compiled
        if include and not any(_matches(r, relative) for r in include):
            return False
        return not any(_matches(r, relative) for r in exclude)

    def argv(self) -> list[str]:
        """The command-line flags that give these patterns, for a child command."""
        return [a for p in self.include for a in ("--glob", p)] + [
            a for p in self.exclude for a in ("--glob", f"!{p}")
        ]

    def flags(self) -> str:
        """The flags as a user would type them (shell-quoted)."""
        return " ".join(shlex.quote(a) if i % 2 else a for i, a in enumerate(self.argv()))


NO_PATTERNS = FilePatterns()


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A FilePatterns glob as a regular expression; a pattern without ``/`` matches a name."""
    pattern = pattern.strip()
    if pattern.endswith("/"):
        pattern += "**"
    anchored = "/" in pattern
    parts = pattern.lstrip("/").split("/")
    out = "" if anchored else "(?:.*/)?"
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out += ".*" if last else "(?:[^/]+/)*"
        else:
            out += _segment_regex(part) + ("" if last else "/")
    return re.compile(out, re.DOTALL)


def _segment_regex(part: str) -> str:
    """One folder or file name of a glob: ``*``, ``?`` and ``[...]`` never cross a ``/``."""
    out, i = "", 0
    while i < len(part):
        c = part[i]
        i += 1
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = part.find("]", i + 1 if i < len(part) and part[i] in "!^" else i)
            if end < 0:
                out += re.escape(c)
                continue
            body = part[i:end]
            i = end + 1
            negate = body[:1] in ("!", "^")
            body = body[1:] if negate else body
            out += "[" + ("^/" if negate else "") + body.replace("\\", "\\\\") + "]"
        else:
            out += re.escape(c)
    return out


def _matches(regex: re.Pattern[str], relative: str) -> bool:
    return regex.fullmatch(relative) is not None
