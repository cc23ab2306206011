"""Servers hand freed memory back to the kernel; trainers keep it (blocktrain/runtime.py): a
flood of request bodies must not leave a server at its peak for good."""

from __future__ import annotations

import sys

import pytest

from blocktrain import runtime
from blocktrain.cli.main import build_parser

SERVERS = {"aggregator", "serve", "serve-block"}


def test_the_servers_and_only_they_run_with_freed_memory_returned():
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert set(choices) >= SERVERS
    for name, sub in choices.items():
        server = sub.get_default("server") or False
        assert server == (name in SERVERS), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_both_memory_modes_take_effect_on_glibc():
    try:
        assert runtime.return_freed_memory()
    finally:
        assert runtime.keep_freed_memory()  # this process is a trainer again
