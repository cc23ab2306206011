"""The import layers of docs/architecture.md, enforced: every module's imports (those inside
functions included) are parsed with `ast`, and an import that the layer table does not allow
fails with the file, the line and the rule. protocol/ (core, store, service, http, worker, ops)
and serving/ (shared, host, router, openai) are checked room by room, and each room's
`__init__.py` must list exactly its modules."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "blocktrain"

BASE = frozenset(
    {
        "config",
        "device",
        "errors",
        "fsutil",
        "httpserve",
        "listener",
        "presets",
        "relaystream",
        "runtime",
        "tensorwire",
        "tls",
    }
)
# protocol/'s rooms, bottom to top; a module of protocol/ is in the part "protocol.ROOM".
ROOMS = ("core", "store", "service", "http", "worker", "ops")
CORE = "protocol.core"
PROTOCOL = frozenset({"protocol", *(f"protocol.{room}" for room in ROOMS)})
# serving/'s rooms: shared/ below host/ and router/, openai/ above router/; a module of serving/
# is in the part "serving.ROOM".
SERVING_ROOMS = ("shared", "host", "router", "openai")
SHARED = "serving.shared"
SERVING = frozenset({"serving", *(f"serving.{room}" for room in SERVING_ROOMS)})
# The packages in rooms, and their rooms in the order their __init__.py lists them.
ROOMED = {"protocol": ROOMS, "serving": SERVING_ROOMS}
# What every room of serving/ may take from below it: the bottom, data, model, training.
SERVING_BASE = BASE | {"data", "model", "training"}
# What each part of the package may import from the package, besides itself. "blocktrain" is the
# package's __init__.py, the public facade; "protocol" is protocol/__init__.py. Bottom to top, as
# docs/architecture.md draws them.
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "runtime": frozenset(),
    "tensorwire": frozenset(),
    "relaystream": frozenset({"tensorwire"}),
    "fsutil": frozenset({"errors"}),
    "httpserve": frozenset({"errors"}),
    "listener": frozenset({"errors", "httpserve", "tls"}),
    "tls": frozenset({"errors"}),
    "config": frozenset({"errors"}),
    "presets": frozenset({"config", "errors"}),
    "device": frozenset({"errors"}),
    "data": BASE,
    "model": frozenset({"config"}),
    "training": BASE | {"data", "model"},
    "protocol": BASE,
    "protocol.core": BASE,
    "protocol.store": BASE | {CORE},
    "protocol.service": BASE | {CORE, "protocol.store"},
    "protocol.http": BASE | {CORE, "protocol.store", "protocol.service"},
    "protocol.worker": BASE | {CORE},
    "protocol.ops": BASE | PROTOCOL,
    "simulate": BASE | {"data", "model", "training", CORE},
    "serving.shared": SERVING_BASE,
    "serving.host": SERVING_BASE | {SHARED},
    "serving.router": SERVING_BASE | {SHARED},
    "serving.openai": SERVING_BASE | {SHARED, "serving.router"},
    "serving": SERVING_BASE | SERVING,
    "blocktrain": BASE | {"data", "model", "training"},
    "cli": BASE | PROTOCOL | SERVING | {"data", "model", "training", "simulate", "blocktrain"},
    "__main__": frozenset({"cli"}),
}
PARTS = frozenset(ALLOWED)
RULES = {
    "model": "model/ is pure math: it imports only torch, the standard library and config",
    "protocol": "protocol/'s modules live in its rooms; its __init__.py imports none of them",
    "protocol.core": "protocol/core/ is the round logic: it imports nothing of protocol/ outside "
    "core/, and of third-party packages only torch and numpy",
    "protocol.store": "protocol/store/ (state folder, ledger) imports only core/ of protocol/",
    "protocol.service": "protocol/service/ (the engine on the wall clock) imports only core/ and "
    "store/ of protocol/, and no web framework",
    "protocol.http": "protocol/http/ (the FastAPI app) imports core/, store/ and service/ of "
    "protocol/, not worker/ or ops/",
    "protocol.worker": "protocol/worker/ (client, loop, doctor) imports only core/ of protocol/",
    "simulate": "simulate/ drives the round logic itself: of protocol/ it imports only "
    "protocol.core",
    "serving.shared": "serving/shared/ is what the router and the hosts both speak: it imports "
    "nothing of serving/ outside shared/",
    "serving.host": "serving/host/ (a block host) imports only shared/ of serving/, not router/ "
    "or openai/",
    "serving.router": "serving/router/ imports only shared/ of serving/: not host/ (it reaches "
    "the hosts over HTTP) nor openai/ (which runs over it)",
    "serving.openai": "serving/openai/ (the OpenAI API, the router's app) imports shared/ and "
    "router/ of serving/, not host/",
}
# model/ and protocol/core/ run anywhere torch does: no third-party package but torch (and,
# for core's coordinate selections, numpy, which torch's tensors share memory with).
TORCH_ONLY = frozenset({"model", CORE})
TORCH = {"model": frozenset({"torch"}), CORE: frozenset({"torch", "numpy"})}
# The web framework stays in protocol/http/ (uvicorn runs through listener, a bottom part).
WEB = frozenset({"fastapi", "starlette", "pydantic", "uvicorn"})
WEB_FREE = PROTOCOL - {"protocol.http", "protocol.ops"}
# serving/'s FastAPI apps are host/host_app.py and openai/; shared/ and router/ take ASGI types
# from starlette and models from pydantic, never FastAPI itself.
FASTAPI = frozenset({"fastapi"})
FASTAPI_FREE = frozenset({SHARED, "serving.router"})
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
    blocktrain -> blocktrain (the facade), blocktrain.protocol.core.rounds -> protocol.core,
    blocktrain.protocol -> protocol (its __init__.py, or a module outside the rooms), and so
    for serving/: blocktrain.serving.host.sweeps -> serving.host."""
    pieces = module.split(".")
    if len(pieces) > 2 and pieces[2] in ROOMED.get(pieces[1], ()):
        return f"{pieces[1]}.{pieces[2]}"
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
            elif target.count(".") == 1 and target.split(".")[1] in ROOMED:
                # from blocktrain.protocol import core, from blocktrain.serving import host
                rooms = ROOMED[target.split(".")[1]]
                found += [
                    (node.lineno, f"{target}.{alias.name}" if alias.name in rooms else target)
                    for alias in node.names
                ]
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
        elif part in TORCH_ONLY and top not in TORCH[part] | sys.stdlib_module_names:
            out.append(Violation(file, line, part, target, RULES[part]))
        elif part in WEB_FREE and top in WEB:
            out.append(Violation(file, line, part, target, f"{part} imports no web framework"))
        elif part in FASTAPI_FREE and top in FASTAPI:
            why = f"{part} imports no FastAPI (the apps are host/host_app.py and openai/)"
            out.append(Violation(file, line, part, target, why))
    return out


def package_violations(src: Path = SRC) -> tuple[list[Violation], set[str]]:
    """The violations in the package's source below `src`, and the modules checked."""
    out: list[Violation] = []
    modules: set[str] = set()
    for path in sorted((src / PACKAGE).rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        file = str(path.relative_to(src.parent))
        out += check_source(path.read_text(), module, file, is_package=is_package)
        modules.add(module)
    return out, modules


LISTED = re.compile(r"^    ([A-Za-z_]\w*)(/?) {2,}\S", re.M)


def listed(init: Path) -> list[tuple[str, bool]]:
    """What a package's `__init__.py` docstring lists, one line each: `    NAME  what it is`
    (a module), or `    NAME/  what it holds` (a subpackage); (name, is a folder) in order."""
    doc = ast.get_docstring(ast.parse(init.read_text(), str(init)), clean=False) or ""
    return [(m.group(1), bool(m.group(2))) for m in LISTED.finditer(doc)]


def room_problems(room: Path) -> list[str]:
    """How a room's module list differs from its files: a module left out, one listed that is
    not there, one listed twice, or a subfolder (a room holds modules only)."""
    name = f"{room.parent.name}/{room.name}"
    if not (room / "__init__.py").is_file():
        return [f"{name} has no __init__.py"]
    entries = listed(room / "__init__.py")
    names = [n for n, _ in entries]
    files = {p.stem for p in room.glob("*.py")} - {"__init__"}
    out = [f"{name}/__init__.py does not list {m}" for m in sorted(files - set(names))]
    out += [f"{name}/__init__.py lists {m}, which is not there" for m in sorted(set(names) - files)]
    out += [
        f"{name}/__init__.py lists {m} twice"
        for m in sorted({n for n in names if names.count(n) > 1})
    ]
    out += [f"{name}/__init__.py lists {n}/: a room holds modules only" for n, d in entries if d]
    out += [
        f"{name}/{p.name}/ is a folder inside a room"
        for p in sorted(room.iterdir())
        if p.is_dir() and p.name != "__pycache__"
    ]
    return out


def unroomed(package: Path, rooms: tuple[str, ...] = ROOMS) -> list[str]:
    """What stands in a package in rooms (protocol/, serving/) outside its rooms: a module beside
    __init__.py, a folder that is not a room, a room missing, and rooms its __init__.py does not
    list in order."""
    name = package.name
    modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    out = [f"{name}/{m} is outside the rooms" for m in modules]
    folders = {p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    out += [f"{name}/{f}/ is not a room of {rooms}" for f in sorted(folders - set(rooms))]
    out += [f"{name}/{r}/ is missing" for r in rooms if r not in folders]
    listed_rooms = [n for n, folder in listed(package / "__init__.py") if folder]
    if listed_rooms != list(rooms):
        out.append(f"{name}/__init__.py lists the rooms {listed_rooms}, not {list(rooms)}")
    return out


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


@pytest.mark.parametrize("name", sorted(ROOMED))
def test_every_module_of_a_package_in_rooms_lives_in_a_listed_room(name):
    package, rooms = SRC / PACKAGE / name, ROOMED[name]
    problems = unroomed(package, rooms) + [p for r in rooms for p in room_problems(package / r)]
    assert not problems, f"{name}/'s rooms (docs/architecture.md):\n" + "\n".join(problems)


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
        ("blocktrain.protocol.core", "from . import rounds", False),  # a package's own module
        ("blocktrain.protocol.core.fake", "from .. import cli", True),
    ],
)
def test_the_checker_on_single_imports(module, source, bad):
    found = check_source(source, module, "fake.py", is_package=module in PACKAGES)
    assert bool(found) == bad, found


PACKAGES = {
    *(f"blocktrain.{name}" for name in ROOMED),
    *(f"blocktrain.{name}.{room}" for name, rooms in ROOMED.items() for room in rooms),
}
# One row per rule of the rooms (docs/architecture.md, "protocol/ in rooms"): what each room may
# import of protocol/ and what it may not, relative imports included, and the third-party rules.
ROOM_CASES = [
    # core imports nothing of protocol/ outside core/, and of third-party packages only torch
    # and numpy
    ("core.fake", "from blocktrain.protocol.core.verdict import Verdict", False),
    ("core.fake", "from . import rounds", False),
    ("core.fake", "import torch", False),
    ("core.fake", "import numpy as np", False),
    ("core.fake", "from blocktrain.protocol.store.ledger import Ledger", True),
    ("core.fake", "from ..store import ledger", True),
    ("core.fake", "from blocktrain.protocol import service", True),
    ("core.fake", "from blocktrain.protocol.http.app import create_app", True),
    ("core.fake", "from blocktrain.protocol.worker.client import AggregatorClient", True),
    ("core.fake", "import blocktrain.protocol.ops.cluster", True),
    ("core.fake", "import blocktrain.protocol", True),  # the package itself is no room
    ("core.fake", "import httpx", True),
    ("core.fake", "import safetensors", True),
    # store imports core
    ("store.fake", "from blocktrain.protocol.core.settings import AggregatorSettings", False),
    ("store.fake", "from ..core import codecs", False),
    ("store.fake", "from blocktrain.protocol.service.identity import Caller", True),
    ("store.fake", "from blocktrain.protocol.http import status", True),
    ("store.fake", "from blocktrain.protocol.worker import loop", True),
    ("store.fake", "import pydantic", True),
    # service imports store and core, and no web framework
    ("service.fake", "from blocktrain.protocol.store.ledger import Ledger", False),
    ("service.fake", "from blocktrain.protocol.core.events import Checked", False),
    ("service.fake", "from blocktrain.protocol.http.dependencies import tag", True),
    ("service.fake", "from blocktrain.protocol.worker.client import AggregatorClient", True),
    ("service.fake", "from blocktrain.protocol.ops import cluster", True),
    ("service.fake", "from fastapi import FastAPI", True),
    ("service.fake", "from starlette.requests import Request", True),
    # http imports core, store and service
    ("http.fake", "from blocktrain.protocol.core.bodies import encode", False),
    ("http.fake", "from blocktrain.protocol.store.storage import StateDir", False),
    ("http.fake", "from blocktrain.protocol.service import aggregator_service", False),
    ("http.fake", "from fastapi import FastAPI", False),
    ("http.fake", "from blocktrain.protocol.worker.client import AggregatorClient", True),
    ("http.fake", "from ..ops import report", True),
    # worker imports core
    ("worker.fake", "from blocktrain.protocol.core.pulls import View", False),
    ("worker.fake", "import httpx", False),
    ("worker.fake", "from blocktrain.protocol.store.storage import StateDir", True),
    ("worker.fake", "from blocktrain.protocol.service.updates import PushContext", True),
    ("worker.fake", "from blocktrain.protocol.http.messages import RegisterOut", True),
    ("worker.fake", "import pydantic", True),
    # ops may import every room and the bottom, nothing else of the package
    ("ops.fake", "from blocktrain.protocol.worker.client import AggregatorClient", False),
    ("ops.fake", "from blocktrain.protocol.http.app import create_app", False),
    ("ops.fake", "from blocktrain.protocol.store import history", False),
    ("ops.fake", "from blocktrain.training.local import initial_blocks", True),
    # the package's __init__.py lists the rooms and imports none of them
    ("", "from blocktrain.protocol.core import verdict", True),
]
SIMULATE_CASES = [
    ("from blocktrain.protocol.core.round_engine import RoundEngine", False),
    ("from blocktrain.protocol.core import codecs", False),
    ("from blocktrain.protocol import core", False),
    ("from blocktrain.protocol.store.state import create_state", True),
    ("from blocktrain.protocol.service.aggregator_service import AggregatorService", True),
    ("from blocktrain.protocol.worker.loop import WorkerLoop", True),
    ("from blocktrain.protocol.http import app", True),
    ("from blocktrain.protocol import ops", True),
]


@pytest.mark.parametrize(("room", "source", "bad"), ROOM_CASES)
def test_the_checker_on_each_rule_of_the_rooms(room, source, bad):
    module = f"blocktrain.protocol.{room}".rstrip(".")
    found = check_source(source, module, "fake.py", is_package=module in PACKAGES)
    assert bool(found) == bad, found


# One row per rule of serving/'s rooms (docs/architecture.md, "serving/ in rooms").
SERVING_ROOM_CASES = [
    # shared imports nothing of serving/ outside shared/, and no FastAPI
    ("shared.fake", "from blocktrain.serving.shared.wire import SweepHeader", False),
    ("shared.fake", "from . import transport", False),
    ("shared.fake", "from blocktrain.model.sampler import check_sampler", False),
    ("shared.fake", "from starlette.types import Scope", False),
    ("shared.fake", "from blocktrain.serving.host.loading import HostedModel", True),
    ("shared.fake", "from ..host import sessions", True),
    ("shared.fake", "from blocktrain.serving.router.replicas import Health", True),
    ("shared.fake", "from blocktrain.serving import openai", True),
    ("shared.fake", "import blocktrain.serving", True),  # the package itself is no room
    ("shared.fake", "from blocktrain.serving import HostSettings", True),
    ("shared.fake", "from fastapi import FastAPI", True),
    ("shared.fake", "from blocktrain.protocol.core import bodies", True),
    # host imports shared
    ("host.fake", "from blocktrain.serving.shared.batching import Batcher", False),
    ("host.fake", "from ..shared import wire", False),
    ("host.fake", "from . import sweeps", False),
    ("host.fake", "from fastapi import FastAPI", False),
    ("host.fake", "from blocktrain.training.checkpoint import load_model", False),
    ("host.fake", "from blocktrain.serving.router.chain_router import Router", True),
    ("host.fake", "from ..router import replicas", True),
    ("host.fake", "from blocktrain.serving.openai.router_app import create_app", True),
    ("host.fake", "from blocktrain.serving import create_router_app", True),
    # router imports shared, neither host nor openai, and no FastAPI
    ("router.fake", "from blocktrain.serving.shared.coalesce import Coalescer", False),
    ("router.fake", "from blocktrain.serving.shared import transport", False),
    ("router.fake", "from . import chain", False),
    ("router.fake", "from pydantic import BaseModel", False),
    ("router.fake", "from blocktrain.serving.host.block_host import BlockHost", True),
    ("router.fake", "from blocktrain.serving import host", True),
    ("router.fake", "from blocktrain.serving.openai.schemas import OpenAIParams", True),
    ("router.fake", "from ..openai import router_app", True),
    ("router.fake", "from fastapi import FastAPI", True),
    # openai imports shared and router, not host
    ("openai.fake", "from blocktrain.serving.router.chain_router import Router", False),
    ("openai.fake", "from blocktrain.serving.shared.serving_errors import BadRequest", False),
    ("openai.fake", "from ..router import limits", False),
    ("openai.fake", "from fastapi import FastAPI", False),
    ("openai.fake", "from blocktrain.serving.host.host_app import create_app", True),
    ("openai.fake", "from ..host import loading", True),
    ("openai.fake", "from blocktrain.simulate import engine", True),
    # the package's __init__.py re-exports the public names from every room
    ("", "from blocktrain.serving.host.host_app import create_app", False),
    ("", "from blocktrain.serving.openai.router_app import create_app", False),
    ("", "from .shared import serving_errors", False),
    ("", "from blocktrain.protocol.core import verdict", True),
]


@pytest.mark.parametrize(("room", "source", "bad"), SERVING_ROOM_CASES)
def test_the_checker_on_each_rule_of_serving_s_rooms(room, source, bad):
    module = f"blocktrain.serving.{room}".rstrip(".")
    found = check_source(source, module, "fake.py", is_package=module in PACKAGES)
    assert bool(found) == bad, found


def test_a_serving_room_s_violation_names_its_rule():
    found = check_source(
        "from ..router import replicas\nfrom fastapi import FastAPI\n",
        "blocktrain.serving.shared.fake",
        "serving/shared/fake.py",
    )
    assert [str(v) for v in found] == [
        "serving/shared/fake.py:1: serving.shared imports blocktrain.serving.router: "
        + RULES["serving.shared"],
        "serving/shared/fake.py:2: serving.shared imports fastapi: serving.shared imports no "
        "FastAPI (the apps are host/host_app.py and openai/)",
    ]


@pytest.mark.parametrize(("source", "bad"), SIMULATE_CASES)
def test_the_checker_on_what_simulate_takes_of_the_protocol(source, bad):
    found = check_source(source, "blocktrain.simulate.fake", "simulate/fake.py")
    assert bool(found) == bad, found
    assert all(RULES["simulate"] in str(v) for v in found), found


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def docstring(*lines: str) -> str:
    """A package docstring listing `lines`, one indented line each, between prose."""
    body = "\n".join(f"    {line}" for line in lines)
    return f'"""A room.\n\n{body}\n\nIts rule.\n"""\n'


def test_the_room_list_check_catches_a_module_left_out_a_ghost_and_a_folder(tmp_path):
    room = write_tree(
        tmp_path / "protocol" / "core",
        {
            "__init__.py": docstring("a      the first", "ghost  gone", "a      again"),
            "a.py": "",
            "b.py": "",
            "deeper/__init__.py": "",
        },
    )
    assert room_problems(room) == [
        "protocol/core/__init__.py does not list b",
        "protocol/core/__init__.py lists ghost, which is not there",
        "protocol/core/__init__.py lists a twice",
        "protocol/core/deeper/ is a folder inside a room",
    ]
    (room / "__init__.py").write_text(docstring("a  the first", "b  the second"))
    (room / "deeper" / "__init__.py").unlink()
    (room / "deeper").rmdir()
    assert room_problems(room) == []


@pytest.mark.parametrize("name", sorted(ROOMED))
def test_the_room_check_catches_a_module_outside_the_rooms(tmp_path, name):
    rooms = ROOMED[name]
    files = {"__init__.py": docstring(*(f"{r}/  the {r} room" for r in rooms))}
    files |= {f"{r}/__init__.py": docstring() for r in rooms}
    package = write_tree(tmp_path / name, files)
    assert unroomed(package, rooms) == []
    write_tree(package, {"stray.py": "", "attic/__init__.py": ""})
    (package / rooms[-1] / "__init__.py").unlink()
    (package / rooms[-1]).rmdir()
    assert unroomed(package, rooms) == [
        f"{name}/stray.py is outside the rooms",
        f"{name}/attic/ is not a room of {rooms}",
        f"{name}/{rooms[-1]}/ is missing",
    ]
    backwards = [f"{r}/  the {r} room" for r in reversed(rooms)]
    (package / "__init__.py").write_text(docstring(*backwards))
    assert unroomed(package, rooms)[-1] == (
        f"{name}/__init__.py lists the rooms {list(reversed(rooms))}, not {list(rooms)}"
    )


def test_a_serving_room_s_list_is_checked_like_protocol_s(tmp_path):
    room = write_tree(
        tmp_path / "serving" / "host",
        {"__init__.py": docstring("loading  what a host loads"), "loading.py": "", "sweeps.py": ""},
    )
    assert room_problems(room) == ["serving/host/__init__.py does not list sweeps"]


def test_the_package_walk_names_each_room_module_by_its_room(tmp_path):
    """The whole check over a synthetic tree: a core module importing store, a store module
    importing service, the simulator importing the worker loop, each found with its file."""
    src = write_tree(
        tmp_path / "src",
        {
            "blocktrain/__init__.py": "",
            "blocktrain/protocol/__init__.py": "",
            "blocktrain/protocol/core/__init__.py": "",
            "blocktrain/protocol/core/x.py": "from ..store import ledger\n",
            "blocktrain/protocol/store/y.py": "from blocktrain.protocol.service import z\n",
            "blocktrain/protocol/service/z.py": "from blocktrain.protocol.store import y\n",
            "blocktrain/simulate/w.py": "import blocktrain.protocol.worker.loop\n",
        },
    )
    found, modules = package_violations(src)
    assert {"blocktrain.protocol.core", "blocktrain.protocol.core.x"} <= modules, modules
    assert [(v.file, v.part, v.imported) for v in found] == [
        ("src/blocktrain/protocol/core/x.py", "protocol.core", "blocktrain.protocol.store"),
        ("src/blocktrain/protocol/store/y.py", "protocol.store", "blocktrain.protocol.service"),
        ("src/blocktrain/simulate/w.py", "simulate", "blocktrain.protocol.worker.loop"),
    ]


def test_the_package_walk_names_each_serving_module_by_its_room(tmp_path):
    """The whole check over a synthetic serving/: shared importing host, host importing router,
    router importing host and openai, openai importing host, and a room importing the package's
    own __init__.py; the __init__.py itself may re-export from every room."""
    src = write_tree(
        tmp_path / "src",
        {
            "blocktrain/__init__.py": "",
            "blocktrain/serving/__init__.py": "from .openai.app import create_app\n",
            "blocktrain/serving/shared/__init__.py": "",
            "blocktrain/serving/shared/wire.py": "from ..host import sweeps\n",
            "blocktrain/serving/host/sweeps.py": "from blocktrain.serving.router import chain\n",
            "blocktrain/serving/router/chain.py": (
                "from blocktrain.serving.shared import wire\n"
                "from blocktrain.serving.host import sweeps\n"
                "from ..openai import app\n"
            ),
            "blocktrain/serving/openai/app.py": (
                "from blocktrain.serving.router import chain\n"
                "from blocktrain.serving.host.sweeps import run\n"
                "from blocktrain.serving import HostSettings\n"
            ),
        },
    )
    found, modules = package_violations(src)
    assert {"blocktrain.serving", "blocktrain.serving.host.sweeps"} <= modules, modules
    assert [(v.file, v.line, v.part, v.imported) for v in found] == [
        ("src/blocktrain/serving/host/sweeps.py", 1, "serving.host", "blocktrain.serving.router"),
        (
            "src/blocktrain/serving/openai/app.py",
            2,
            "serving.openai",
            "blocktrain.serving.host.sweeps",
        ),
        ("src/blocktrain/serving/openai/app.py", 3, "serving.openai", "blocktrain.serving"),
        ("src/blocktrain/serving/router/chain.py", 2, "serving.router", "blocktrain.serving.host"),
        (
            "src/blocktrain/serving/router/chain.py",
            3,
            "serving.router",
            "blocktrain.serving.openai",
        ),
        ("src/blocktrain/serving/shared/wire.py", 1, "serving.shared", "blocktrain.serving.host"),
    ]
