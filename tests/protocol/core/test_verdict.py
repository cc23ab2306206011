"""The refusal table: documented, 4xx only; and the package's layering."""

from __future__ import annotations

import ast
from pathlib import Path

import blocktrain.protocol as protocol
from blocktrain.protocol.core.verdict import REASONS

ROOT = Path(__file__).resolve().parents[3]


def test_every_reason_is_a_4xx_and_documented():
    doc = (ROOT / "docs" / "protocol.md").read_text()
    for reason, (status, meaning) in REASONS.items():
        assert 400 <= status < 500, reason
        assert meaning
        assert f"| `{reason}` | {status} |" in doc, f"{reason} is not in docs/protocol.md"


def test_protocol_never_imports_the_model():
    for path in Path(protocol.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith(("blocktrain.model", "blocktrain.training")), (
                    f"{path.name} imports {name}"
                )
