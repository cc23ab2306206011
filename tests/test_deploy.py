"""The deployment files stay true to the code: every metric the Grafana dashboard queries is one
the aggregator exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

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
