"""The deployment files stay true to the code: every metric the Grafana dashboard queries is one
the aggregator exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.protocol.conftest import make_harness

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def test_grafana_queries_only_exported_metrics(tmp_path: Path) -> None:
    h = make_harness(tmp_path / "state")
    h.register(h.alice, block=0)
    exported = set(re.findall(r"^# TYPE (blocktrain_\w+)", h.client.get("/metrics").text, re.M))
    h.state.close()
    dashboard = json.loads((DEPLOY / "grafana" / "blocktrain.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"blocktrain_\w+", target["expr"])
    }
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def test_compose_commands_are_valid_blocktrain_commands() -> None:
    """Every service of deploy/compose.yaml runs a command line the CLI accepts, so that the
    compose file cannot drift from the flags; `docker-compose config` validates the file itself
    where it is installed."""
    yaml = pytest.importorskip("yaml")
    from blocktrain.cli.main import build_parser

    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    parser = build_parser()
    commands = [s["command"] for s in compose["services"].values() if "entrypoint" not in s]
    assert len(commands) >= 11  # aggregator, 6 workers, export, 3 hosts, router
    for argv in commands:
        parser.parse_args(argv)  # SystemExit(2) on a flag the CLI does not know
    script = compose["services"]["secrets"]["command"][0]
    (token_add,) = re.findall(r"blocktrain (token add [^>]+)>", script)
    parser.parse_args(token_add.replace("$$i", "0").split())
    if shutil.which("docker-compose"):
        done = subprocess.run(
            [
                "docker-compose",
                "-f",
                str(DEPLOY / "compose.yaml"),
                "--profile",
                "serve",
                "config",
                "-q",
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
