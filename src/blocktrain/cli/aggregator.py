"""`blocktrain aggregator`: serve decentralised training of a run's blocks over HTTP.

A new --state folder is created from --preset (version 0 of every block, initialised from the
run's seed); an existing one is resumed from its last committed version, and flags given here
replace its saved protocol settings. Stop it with Ctrl-C or SIGTERM; kill it at any time: the
state folder is consistent after every commit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from blocktrain.cli.common import Formatter, add_config_args, resolve_config
from blocktrain.config import RunConfig
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.protocol.settings import AggregatorSettings
from blocktrain.protocol.storage import StateDir
from blocktrain.training.local import derived_settings, initial_blocks

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  blocktrain aggregator --state runs/agg --preset tiny --port 8470
  blocktrain token add --state runs/agg --name alice          # prints the token
  blocktrain aggregator --state runs/agg --deadline 30         # resume with a new deadline
  blocktrain aggregator --state runs/agg --tls-cert cert.pem --tls-key key.pem
"""

# flag -> settings field, for the flags that map one to one
SETTING_FLAGS = {
    "deadline": "deadline_s",
    "local_steps": "local_steps",
    "max_rounds": "max_rounds",
    "staleness": "staleness",
    "stale_weight": "stale_weight",
    "rule": "rule",
    "trim": "trim",
    "outer_lr": "outer_lr",
    "outer_momentum": "outer_momentum",
    "wire_dtype": "wire_dtype",
    "max_delta_norm": "max_delta_norm",
    "max_tokens": "max_tokens",
    "max_body_bytes": "max_body_bytes",
    "n_workers": "n_workers",
    "keep_versions": "keep_versions",
    "live_window": "live_window_s",
}


def add_protocol_args(
    p: argparse.ArgumentParser,
    title: str = "protocol settings (saved in the state folder)",
    exclude: tuple[str, ...] = (),
) -> None:
    """The protocol settings (shared with `blocktrain cluster` and `simulate`, which leaves out
    the flags in `exclude`); None means "keep/default"."""
    g = p.add_argument_group(title)
    g.argument_default = argparse.SUPPRESS  # absent flags keep the saved or default value

    def add(flag: str, **kwargs: Any) -> None:
        if flag[2:].replace("-", "_") not in exclude:
            g.add_argument(flag, **kwargs)

    add(
        "--deadline",
        type=float,
        metavar="S",
        help="seconds from a round's first pull to its deadline (default 60)",
    )
    add("--local-steps", type=int, metavar="H", help="local AdamW steps per round (default 10)")
    add(
        "--max-rounds",
        type=int,
        metavar="R",
        help="rounds per block, then stop (default: run until stopped)",
    )
    add(
        "--staleness",
        type=int,
        metavar="S",
        help="count updates up to S rounds late, down-weighted (default 0: refuse them as late)",
    )
    add("--stale-weight", type=float, help="weight factor per round of lateness")
    add(
        "--rule",
        choices=("mean", "median", "trimmed_mean"),
        help="aggregation rule (default mean, token-weighted)",
    )
    add("--trim", type=float, help="fraction trimmed per end by trimmed_mean")
    add("--outer-lr", type=float, help="outer learning rate (default 1)")
    add("--outer-momentum", type=float, help="outer Nesterov momentum (default 0)")
    add(
        "--wire-dtype",
        choices=("fp16", "bf16", "fp32"),
        help="dtype of weights and deltas on the wire (default fp16)",
    )
    add(
        "--max-delta-norm",
        type=float,
        help="refuse deltas with a larger L2 norm (default: 4 x lr x H x sqrt(params))",
    )
    add(
        "--max-tokens",
        type=int,
        help="refuse larger token counts (default: 2 x H x batch x seq_len)",
    )
    add(
        "--max-body-bytes",
        type=int,
        help="request size limit (default: twice the block's fp32 size + 1 MiB)",
    )
    add("--n-workers", type=int, help="data-seed stride: seed * n + worker_id")
    add("--keep-versions", type=int, help="committed versions kept per block (0: all; default 3)")
    add(
        "--live-window",
        type=float,
        metavar="S",
        help="a worker heard from within S seconds is live (default 3 x deadline)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "aggregator",
        help="serve decentralised training over HTTP",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("--state", required=True, metavar="DIR", help="the aggregator's state folder")
    add_config_args(p)
    for action in p._actions:  # a new state needs an explicit --preset; a resumed one none
        if action.dest == "preset":
            action.default = None
    p.add_argument("--seed", type=int, help="run seed (a new state only)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8470, help="port (0: any free port)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    p.add_argument("--tls-key", metavar="PEM", help="... and this private key")
    add_protocol_args(p)
    p.set_defaults(handler=run)


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        field: getattr(args, flag)
        for flag, field in SETTING_FLAGS.items()
        if getattr(args, flag, None) is not None
    }


def create_state(state_dir: Path, cfg: RunConfig, overrides: dict[str, Any]) -> StateDir:
    """A new state folder for `cfg`, with the norm and token bounds derived from it."""
    blocks = initial_blocks(cfg)
    settings = derived_settings(cfg, overrides, blocks)
    return StateDir.create(state_dir, run_config=cfg.to_dict(), settings=settings, blocks=blocks)


def prepare_state(args: argparse.Namespace) -> tuple[StateDir, AggregatorSettings]:
    state = StateDir(Path(args.state))
    overrides = settings_overrides(args)
    if state.initialised:
        if args.preset is not None or args.overrides or args.seed is not None:
            raise ConfigError(
                f"{args.state} already holds a run; omit --preset/--set/--seed "
                "to resume it, or choose a new --state"
            )
        settings = state.settings().replace(**overrides)
        if overrides:
            state.write_manifest(
                run_config=state.run_config(), settings=settings, n_blocks=state.n_blocks()
            )
        return state, settings
    if args.preset is None:
        raise ConfigError(
            f"{args.state} holds no aggregator state yet: give --preset NAME to create one"
        )
    cfg = resolve_config(args)
    state = create_state(Path(args.state), cfg, overrides)
    return state, state.settings()


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ProtocolError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --host/--port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from blocktrain.protocol.aggregator import create_app

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path and not Path(path).is_file():
            raise ConfigError(f"{path} does not exist")
    state, settings = prepare_state(args)
    app = create_app(settings, storage=state)
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    scheme = "https" if args.tls_cert else "http"
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"{scheme}://{shown}:{port}"
    config = uvicorn.Config(
        app,
        log_level="debug" if args.verbose else "warning",
        ssl_certfile=args.tls_cert,
        ssl_keyfile=args.tls_key,
        timeout_keep_alive=30,
        access_log=False,
    )
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the handler
    # it found; with these no-op handlers the process then exits 0 through the cleanup below.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    state.write_endpoint(url, os.getpid())
    print(
        f"aggregator for {state.n_blocks()} blocks listening on {url} (state {args.state})",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        state.clear_endpoint()
        state.close()
        sock.close()
    return 0
