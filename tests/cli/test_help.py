"""Every subcommand's --help: examples that a user can paste (each `blocktrain ...` line parses,
its line breaks intact), each default said once, no internal references; and what the help
promises about --name holds."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest
from fastapi.testclient import TestClient

from blocktrain.cli.main import build_parser
from blocktrain.cli.status import render
from blocktrain.protocol.http.app import create_app
from tests.protocol.conftest import FakeClock, add_token, auth, make_state


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def help_text(name: str) -> str:
    return subcommands()[name].format_help()


def example_commands(text: str) -> list[str]:
    """The `blocktrain ...` lines after "examples:", continuation lines joined."""
    body = text.split("examples:", 1)[1].replace("\\\n", " ")
    found = []
    for line in body.splitlines():
        words = line.split()
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]  # VAR=value blocktrain ...
        if words and words[0] == "blocktrain":
            found.append(line)
    return found


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_help_says_each_default_once_and_no_internal_reference(name):
    text = " ".join(help_text(name).split())  # argparse wraps lines anywhere
    assert not re.search(r"\(default: [^)]*\)\s*\(default:", text), name
    assert "STYLE" not in text, name


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_example_parses_and_keeps_its_line_breaks(name):
    text = help_text(name)
    assert "examples:" in text, f"{name} --help has no examples"
    examples = text.split("examples:", 1)[1]
    for line in examples.splitlines():
        # a line break lost to a single backslash in the source: "...pem       --token-file"
        assert not re.search(r"\S {4,}--", line.split(" #")[0]), f"{name}: {line.strip()}"
    commands = example_commands(text)
    assert commands, f"{name} --help shows no blocktrain command"
    for line in commands:
        words = shlex.split(line, comments=True)
        words = [w for w in words[words.index("blocktrain") + 1 :] if w != "&"]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                build_parser().parse_args(words)
            except SystemExit as exc:
                pytest.fail(f"{name} example {line.strip()!r}: {err.getvalue().strip()} ({exc})")


def test_a_workers_name_shows_in_the_status(tmp_path):
    assert "shown in the aggregator's status" in help_text("worker")
    state = make_state(tmp_path / "s")
    alice, bob = add_token(state, "alice"), add_token(state, "bob")
    client = TestClient(create_app(storage=state, clock=FakeClock()), base_url="http://agg")
    client.post("/v1/workers", json={"block": 0, "name": "alice-laptop"}, headers=auth(alice))
    client.post("/v1/workers", json={"block": 1}, headers=auth(bob))
    status = client.get("/v1/status", headers=auth(alice)).json()
    assert [w["name"] for w in status["workers"]["list"]] == ["alice-laptop", None]
    shown = render(status, rounds=1)
    assert "alice-laptop: block 0, live" in shown
    state.close()


def test_serve_points_at_the_drafting_guidance_that_exists():
    """Issue 30, friction 8: nothing told a user which --draft-bytes to pick (D = 6 beat 16 on
    a quiet machine, and drafting lost to none under load). `serve --help` names the guidance
    and docs/serving.md holds it, with the yield bound it reasons from."""
    from pathlib import Path

    text = " ".join(help_text("serve").split())
    assert "docs/serving.md, Which D to pick" in text
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc.split("**Which D to pick.**", 1)
    assert len(section) == 2, "docs/serving.md lost its 'Which D to pick' section"
    assert "(1 - a^(D+1)) / (1 - a)" in section[1][:400]
