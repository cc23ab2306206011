"""A block host or a router in its own process, built from `HostSettings` / `RouterSettings` in
Python: the load bench's batching switches (`batch_rows`, `coalesce_sweeps`,
`coalesce_window_ms`) are settings that `blocktrain serve-block` and `blocktrain serve` give no
flag. `serving.chain(..., host_settings=..., router_settings=...)` starts these in place of the
CLI's processes; every other field keeps the CLI's default.

    python bench/serving_procs.py host '{"models": {"small": "RUN"}, "parts": [0], "port": 8101,
        "threads": 1, "batch_rows": 1}'
    python bench/serving_procs.py router '{"hosts": ["http://127.0.0.1:8101"], "port": 8100,
        "coalesce_sweeps": 1}'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from blocktrain.listener import bind, run, url_of
from blocktrain.runtime import serve_from_heap
from blocktrain.serving.host.host_app import create_app as host_app
from blocktrain.serving.host.host_settings import HostSettings
from blocktrain.serving.host.loading import ModelSource
from blocktrain.serving.openai.router_app import create_app as router_app
from blocktrain.serving.router.router_settings import RouterSettings


def host(spec: dict[str, Any]) -> None:
    """`blocktrain serve-block` on loopback with these HostSettings fields."""
    threads = spec.pop("threads", 0)
    if threads:
        torch.set_num_threads(threads)
    models = tuple(ModelSource(name, Path(d)) for name, d in spec.pop("models").items())
    sock = bind("127.0.0.1", spec.pop("port"))
    settings = HostSettings(
        models=models, parts=tuple(spec.pop("parts")), public_url=url_of(sock), **spec
    )
    run(host_app(settings), sock)


def router(spec: dict[str, Any]) -> None:
    """`blocktrain serve` on loopback with these RouterSettings fields."""
    sock = bind("127.0.0.1", spec.pop("port"))
    run(router_app(RouterSettings(hosts=tuple(spec.pop("hosts")), **spec)), sock)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("kind", choices=("host", "router"))
    p.add_argument("spec", help="the settings' fields as one JSON object")
    args = p.parse_args()
    serve_from_heap()  # as the CLI's serve and serve-block do
    {"host": host, "router": router}[args.kind](json.loads(args.spec))


if __name__ == "__main__":
    main()
