"""The CLI tests' shared fixture: a run trained for two steps at a tiny shape."""

from __future__ import annotations

import pytest

from blocktrain.cli.main import main
from tests.cli.test_cli import TINY


@pytest.fixture
def trained(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--steps", "2", *TINY]) == 0
    capsys.readouterr()
    return run
