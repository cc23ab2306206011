"""Progress bars: drawn on stderr when it is a terminal, never into a pipe or a log, and off
with --quiet (alias --no-progress)."""

from __future__ import annotations

import io
import sys

import pytest

from blocktrain.cli.main import main


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("tty", "flags", "drawn"),
    [
        (True, [], True),
        (True, ["--quiet"], False),
        (True, ["--no-progress"], False),
        (False, [], False),
    ],
)
def test_eval_draws_a_bar_only_on_a_terminal(trained, corpus, monkeypatch, tty, flags, drawn):
    err = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    argv = ["eval", str(trained), "--data", str(corpus), "--bytes", "256", "--sweeps", "2", *flags]
    assert main(argv) == 0
    text = err.getvalue()
    assert ("window" in text and "eval" in text) is drawn, text
