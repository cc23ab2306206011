"""Serving the head exit: a features stack's blocks as pipeline stages, against the reference's.

The same three `serve-block` hosts and `serve` router as bench/serving.py (real processes on
loopback, hop latency emulated in the transport, random weights of one shape): a `route =
features` BlockTrain run answered through its head exit (`exit: "head"`, one traversal per byte
through the blocks' cached clean streams, docs/serving.md) and the end-to-end reference split
into the same number of stages (the autoregressive baseline). Both read one token per stage per
byte; the head exit's hops also carry the new bytes beside the hidden states.

    python bench/serving_head.py                       # outputs 16, 64; hops 0, 10 ms
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

from blocktrain.config import RunConfig
from blocktrain.serving.host.loading import write_untrained_run
from blocktrain.serving.host.shapes import parse_shape
from report import machine, update_section, write_json
from serving import chain, measure, timed

RESULT = "serving_head.json"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="d=256,layers=6,blocks=3,seq=512")
    p.add_argument("--outputs", default="16,64")
    p.add_argument("--hops", default="0,10", help="emulated one-way hop latency, ms")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per host")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    _, shape = parse_shape(args.shape)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    head = {"exit": "head"}
    with tempfile.TemporaryDirectory() as tmp:
        features = dataclasses.replace(shape, span=1, route="features")
        models = {
            "head": write_untrained_run(
                RunConfig(preset="bench-serving", model=features), Path(tmp) / "bt"
            ),
            "ref": write_untrained_run(
                RunConfig(preset="bench-serving", model=dataclasses.replace(shape, span=1)),
                Path(tmp) / "ref",
                kind="reference",
            ),
        }
        for hop in [float(h) for h in args.hops.split(",")]:
            nodelay = httpx.HTTPTransport(
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            )
            with (
                chain(models, hop, args.threads) as router,
                httpx.Client(timeout=600, transport=nodelay) as client,
            ):
                timed(client, router, "ref", 4, seed=0)  # warm up both paths
                timed(client, router, "head", 4, seed=0, extra=head)
                for n in [int(v) for v in args.outputs.split(",")]:
                    ar = measure(client, router, "ref", n, args.repeats)
                    ours = measure(client, router, "head", n, args.repeats, extra=head)
                    row = {
                        "output_bytes": n,
                        "hop_ms": hop,
                        "head_bytes_per_s": n / ours["seconds"],
                        "ar_bytes_per_s": n / ar["seconds"],
                        "ratio": ar["seconds"] / ours["seconds"],
                        "head_traversals": ours["traversals"],
                        "ar_traversals": ar["traversals"],
                        "head_host_compute_s": ours["host_compute_s"],
                        "ar_host_compute_s": ar["host_compute_s"],
                        "head_transport_ms_per_link": ours["transport_ms_per_link"],
                        "ar_transport_ms_per_link": ar["transport_ms_per_link"],
                    }
                    rows.append(row)
                    print(
                        f"n={n:4d} hop={hop:3.0f} ms  head {row['head_bytes_per_s']:7.1f} B/s  "
                        f"AR {row['ar_bytes_per_s']:7.1f} B/s  ratio {row['ratio']:.2f}",
                        flush=True,
                    )
    doc = {
        "command": ("python bench/serving_head.py " + " ".join(sys.argv[1:])).strip(),
        "machine": machine(),
        "shape": dataclasses.asdict(shape),
        "weights": "random (freshly initialised, untrained)",
        "threads_per_host": args.threads,
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
        "results": rows,
    }
    write_json(RESULT, doc)
    update_section("serving-head", table(doc))


def table(doc: dict[str, Any]) -> str:
    lines = [
        f"`{doc['command']}` (JSON `benchmarks/results/{RESULT}`): 3 hosts and a router on "
        "loopback, random weights of d = {d}, {layers} layers in {blocks} blocks, T = {seq}; "
        "one traversal per byte on both.".format(
            d=doc["shape"]["d_model"],
            layers=doc["shape"]["layers"],
            blocks=doc["shape"]["blocks"],
            seq=doc["shape"]["seq_len"],
        ),
        "",
        "| output bytes | hop ms | head exit B/s | AR pipeline B/s | head / AR | host compute s (head, AR) | transport ms per link (head, AR) |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['output_bytes']} | {r['hop_ms']:.0f} | {r['head_bytes_per_s']:.1f} | "
            f"{r['ar_bytes_per_s']:.1f} | {r['ratio']:.2f} | "
            f"{r['head_host_compute_s']:.2f}, {r['ar_host_compute_s']:.2f} | "
            f"{r['head_transport_ms_per_link']:.2f}, {r['ar_transport_ms_per_link']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
