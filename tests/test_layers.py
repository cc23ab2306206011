"""The import layers of docs/architecture.md, enforced: every module's imports (those inside
functions included) are parsed with `ast`, and an import that the layer table does not allow
fails with the file, the line and the rule."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "blocktrain"

BASE = frozenset(
    {"config", "device", "errors", "fsutil", "httpserve", "runtime", "tensorwire", "tls"}
)
# What each part of the package may import from the package, besides itself. "blocktrain" is the
# package's __init__.py, the public facade. Bottom to top, as docs/architecture.md draws them.
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "runtime": frozenset(),
    "tensorwire": frozenset(),
    "fsutil": frozenset({"errors"}),
    "httpserve": frozenset({"errors", "tls"}),
    "tls": frozenset({"errors"}),
    "config": frozenset({"errors"}),
    "device": frozenset({"errors"}),
    "data": BASE,
    "model": frozenset({"config"}),
    "training": BASE | {"data", "model"},
    "protocol": BASE,
    "simulate": BASE | {"data", "model", "training", "protocol"},
    "serving": BASE | {"data", "model", "training"},
    "blocktrain": BASE | {"data", "model", "training"},
    "cli": BASE | {"data", "model", "training", "protocol", "simulate", "serving", "blocktrain"},
}
PARTS = frozenset(ALLOWED)
RULES = {
    "model": "model/ is pure math: it imports only torch, the standard library and config",
    "protocol": "protocol/ moves tensors as payload: it never imports model/, training/ or data/",
}
# model/ runs anywhere torch does: no third-party package but torch.
MODEL_THIRD_PARTY = frozenset({"torch"})
# Names that come from the facade without its imports: package metadata.
METADATA = frozenset({"__version__"})

# Known violations in files that others are changing, left for them to fix; the lead empties
# this list. An
# entry that no longer matches an import fails the test too, so the list cannot go stale.
KNOWN: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    part: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.part} imports {self.imported}: {self.rule}"


def part_of(module: str) -> str:
    """The part a dotted module of the package belongs to: blocktrain.training.loss -> training,
    blocktrain -> blocktrain (the facade)."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else PACKAGE


def rule_for(part: str) -> str:
    allowed = ", ".join(sorted(ALLOWED[part])) or "nothing"
    return RULES.get(part, f"{part} may import only {allowed} from {PACKAGE}")


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in `tree`, relative ones resolved; `from blocktrain
    import x` names the part x when x is one, else the facade."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PACKAGE:
                for alias in node.names:
                    if alias.name in PARTS:
                        found.append((node.lineno, f"{PACKAGE}.{alias.name}"))
                    elif alias.name not in METADATA:
                        found.append((node.lineno, PACKAGE))
            else:
                found.append((node.lineno, target))
    return found


def check_source(
    source: str, module: str, file: str, *, is_package: bool = False
) -> list[Violation]:
    """The layer violations of one module's source."""
    part = part_of(module)
    out: list[Violation] = []
    for line, target in imported_modules(ast.parse(source, file), module, is_package):
        top = target.split(".")[0]
        if top == PACKAGE:
            other = part_of(target)
            if other != part and other not in ALLOWED[part]:
                out.append(Violation(file, line, part, target, rule_for(part)))
        elif part == "model" and top not in MODEL_THIRD_PARTY | sys.stdlib_module_names:
            out.append(Violation(file, line, part, target, RULES["model"]))
    return out


def package_violations() -> tuple[list[Violation], set[str]]:
    """The violations in the package's source, and the modules checked."""
    out: list[Violation] = []
    modules: set[str] = set()
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        file = str(path.relative_to(SRC.parent))
        out += check_source(path.read_text(), module, file, is_package=is_package)
        modules.add(module)
    return out, modules


def test_every_part_is_in_the_layer_table():
    parts = {p.stem if p.is_file() else p.name for p in (SRC / PACKAGE).iterdir()}
    parts = {p for p in parts if not p.startswith(("_", ".")) and p != "py.typed"}
    assert parts <= PARTS, f"add {sorted(parts - PARTS)} to ALLOWED and docs/architecture.md"


def test_no_lower_layer_imports_a_higher_one():
    found, modules = package_violations()
    assert {"blocktrain", "blocktrain.model.block", "blocktrain.cli.main"} <= modules, modules
    unknown = [v for v in found if (v.file, v.imported) not in KNOWN]
    assert not unknown, "layer violations (docs/architecture.md):\n" + "\n".join(map(str, unknown))
    stale = set(KNOWN) - {(v.file, v.imported) for v in found}
    assert not stale, f"KNOWN lists imports that are gone; remove them: {sorted(stale)}"


FAKE_MODEL = """
import math
import torch
import httpx
from blocktrain.config import ModelConfig
from blocktrain import config, Trainer, __version__


def helper():
    from blocktrain.protocol.core.bodies import decode  # inside a function: still an import
    from ..training import loss
    return decode, loss
"""


def test_the_checker_catches_a_synthetic_violation():
    found = check_source(FAKE_MODEL, "blocktrain.model.fake", "model/fake.py")
    got = [(v.line, v.imported) for v in found]
    assert got == [
        (4, "httpx"),
        (6, PACKAGE),  # Trainer comes from the facade, which imports training/
        (10, "blocktrain.protocol.core.bodies"),
        (11, "blocktrain.training"),
    ], got
    assert str(found[2]) == (
        "model/fake.py:10: model imports blocktrain.protocol.core.bodies: " + RULES["model"]
    )


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("blocktrain.protocol.fake", "from blocktrain.model import Block", True),
        ("blocktrain.protocol.fake", "from blocktrain.training.step import stream_seed", True),
        ("blocktrain.protocol.fake", "from blocktrain.errors import ProtocolError", False),
        ("blocktrain.training.fake", "import blocktrain.protocol.core.settings", True),
        ("blocktrain.training.fake", "from blocktrain.model import Block", False),
        ("blocktrain.serving.fake", "from blocktrain.simulate import engine", True),
        ("blocktrain.data.fake", "from blocktrain import model", True),
        ("blocktrain.cli.fake", "from blocktrain.simulate import engine", False),
        ("blocktrain.protocol", "from . import wire", False),  # a package's own submodule
        ("blocktrain.protocol.fake", "from .. import cli", True),
    ],
)
def test_the_checker_on_single_imports(module, source, bad):
    found = check_source(source, module, "fake.py", is_package=module == "blocktrain.protocol")
    assert bool(found) == bad, found
