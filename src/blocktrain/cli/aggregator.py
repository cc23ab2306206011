"""`blocktrain aggregator`: serve decentralised training of a run's blocks over HTTP.

A new --state folder is created from --preset (version 0 of every block, initialised from the
run's seed); an existing one is resumed from its last committed version, and flags given here
replace its saved protocol settings. The folder saves the run, the settings, the blocks served
(--blocks) and their peers (--peer) at the first start, and its ledger keeps every round,
update, token, ban and reputation: a restart carries on where the last process stopped. Without
--blocks a restart serves the saved blocks; other blocks are refused (exit 2). A --peer
replaces its block's saved URL. Stop it with Ctrl-C or SIGTERM; kill it at any time: the
state folder is consistent after every commit.

Limits: every body is capped before it is read (pushes at max_body_bytes, JSON at 16 KiB),
tokens are checked before bodies, each token may send --rate-limit requests a second (after a
burst of four seconds' worth), a request's head must arrive within 10 s and its body at 16 KiB/s
after 30 s, and at most max_connections (--set) are served at once. /v1/status always needs a
token; /metrics needs one with --private-status (default: public, for Prometheus scrapers).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import secrets
import socket
import sys

from blocktrain.cli.aggregator_state import AggregatorSetup, prepare_state, remove_new
from blocktrain.cli.common import (
    Formatter,
    add_config_args,
    add_data_arg,
    add_setting_args,
    add_tls_args,
    add_unit_arg,
    file_patterns,
)
from blocktrain.config import RunConfig
from blocktrain.data import ByteSource, load_split
from blocktrain.errors import ConfigError, DataError
from blocktrain.httpserve import Limits
from blocktrain.listener import bind, url_of
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.service.access import JSON_BODY_BYTES, AccessLimits
from blocktrain.protocol.store.state import run_unit
from blocktrain.protocol.store.storage import StateDir
from blocktrain.tls import require_tls, tls_pair
from blocktrain.training.live_eval import AssembledEval
from blocktrain.training.probe import BlockProbe

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  blocktrain aggregator --state runs/agg --preset tiny --port 8470
  blocktrain token add --state runs/agg --name alice          # prints the token
  blocktrain aggregator --state runs/agg --deadline 30         # resume with a new deadline
  blocktrain tls self-signed --out tls --host agg.example      # then:
  blocktrain aggregator --state runs/agg --host 0.0.0.0 --tls-cert tls/cert.pem \\
      --tls-key tls/key.pem                                    # off loopback: TLS, or
  blocktrain aggregator --state runs/agg --host 0.0.0.0 --insecure-http   # TLS at a proxy
  blocktrain aggregator --state runs/agg --private-status --rate-limit 20
  blocktrain aggregator --state runs/agg --public-weights    # versions cacheable by a CDN
  # one aggregator per block, same preset and seed, one state folder each (block 1 reads
  # block 0, served elsewhere, so its aggregator runs no effect probe; route=state keeps it):
  blocktrain aggregator --state runs/agg0 --preset tiny --blocks 0 --port 8470 \\
      --peer 1=http://10.0.0.6:8471 --peer 2=http://10.0.0.7:8472
  blocktrain aggregator --state runs/agg1 --preset tiny --blocks 1 --port 8471 \\
      --peer 0=http://10.0.0.5:8470 --peer 2=http://10.0.0.7:8472 --effect-probe off
  blocktrain token add alice --state runs/agg0 --state runs/agg1 --state runs/agg2
  blocktrain aggregator --state runs/agg0 --port 8470       # restart: block 0, saved peers
  blocktrain aggregator --state runs/agg0 --port 8470 --peer 1=http://10.0.0.8:8471  # moved
  blocktrain aggregator --state runs/agg --data wikitext/   # the effect probe's held-out slice
  # the validation CE of the assembled model every 5 rounds, live on /dashboard and in
  # /v1/history (4096 bytes, M = 1: 0.6 s on one CPU thread at tiny, in the background):
  blocktrain aggregator --state runs/agg --data wikitext/ --set live_eval_every=5
  blocktrain aggregator --state runs/agg --set live_eval_every=5 \\
      --set live_eval_bytes=8192 live_eval_sweeps=2           # 4x the bytes x sweeps, 4x the cost
  blocktrain aggregator --state runs/agg --set live_eval_every=0   # no live evaluation (default)
  blocktrain aggregator --state runs/agg --effect-probe off --rule trimmed_mean --tolerate 1
  blocktrain aggregator --state runs/agg --wire int8        # deltas as int8, a scale per row
  blocktrain aggregator --state runs/agg --wire topk:0.03   # 3 % of each delta, error feedback
  blocktrain aggregator --state runs/agg --wire sparse:0.03:2   # 3 % of each 64x64 chunk, 2 bits
"""


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
    add_unit_arg(p)
    for action in p._actions:  # a new state needs an explicit --preset; a resumed one none
        if action.dest == "preset":
            action.default = None
    p.add_argument("--seed", type=int, help="run seed (a new state only)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8470, help="port (0: any free port)")
    add_tls_args(p)
    limits = AccessLimits()
    p.add_argument(
        "--private-status",
        action="store_true",
        help="/metrics needs a token too (/v1/status always does)",
    )
    p.add_argument(
        "--blocks",
        metavar="B[,B...]",
        help="serve only these blocks (default: all); run one aggregator per block or subset, "
        "each with its own --state, and name the others with --peer. Saved in the state at "
        "its first start: a restart without --blocks serves them, one with others exits 2",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="BLOCK=URL",
        help="where another aggregator serves BLOCK (repeatable), for GET /v1/directory: "
        "workers asking here for BLOCK are sent there. Saved in the state; at a restart a "
        "--peer replaces its block's saved URL, and the others stay",
    )
    p.add_argument(
        "--public-weights",
        action="store_true",
        help="serve committed versions (GET /v1/blocks/B/versions/V) without a token and as "
        "Cache-Control: public, so that a CDN may cache them for every worker; the weights are "
        "then readable by anyone who reaches the URL",
    )
    p.add_argument(
        "--rate-limit",
        type=float,
        default=limits.rate_per_s,
        metavar="R",
        help="requests a second each token may send, after a burst of 4 seconds' worth",
    )
    add_data_arg(p)  # the validation split feeds the effect probe and live_eval_every
    add_setting_args(p)
    p.set_defaults(handler=run, server=True)  # runtime.serve_from_heap


def needs_data(settings: AggregatorSettings) -> bool:
    """The effect probe and the live evaluation read the validation split."""
    return settings.effect_probe != "off" or settings.live_eval_every > 0


def access_limits(args: argparse.Namespace, settings: AggregatorSettings) -> AccessLimits:
    return AccessLimits(
        http=Limits(
            max_body=JSON_BODY_BYTES,
            max_connections=settings.max_connections,
            max_connections_per_address=settings.max_connections_per_address,
        ),
        rate_per_s=args.rate_limit,
        burst=burst_of(args.rate_limit),
        private_status=args.private_status,
        public_weights=args.public_weights,
    )


BURST_S = AccessLimits().burst / AccessLimits().rate_per_s
"""A token's burst, in seconds of its rate: 4 (200 requests at the default 50/s)."""


def burst_of(rate_per_s: float) -> int:
    """A token's burst at --rate-limit `rate_per_s`: BURST_S seconds' worth, at least 1 (a rate
    that is not positive and finite is refused by `AccessLimits`)."""
    return max(1, round(BURST_S * rate_per_s)) if math.isfinite(rate_per_s) else 1


def probe_data(args: argparse.Namespace, settings: AggregatorSettings | None = None) -> ByteSource:
    """The validation split of --data that the effect probe and the live evaluation read."""
    try:
        return load_split(args.data, "valid", file_patterns(args))
    except DataError as exc:
        users = []
        if settings is None or settings.effect_probe != "off":
            users.append(("the effect probe", "--effect-probe off"))
        if settings is not None and settings.live_eval_every > 0:
            users.append(
                (f"--set live_eval_every={settings.live_eval_every}", "--set live_eval_every=0")
            )
        raise ConfigError(
            f"{' and '.join(u for u, _ in users)} need{'s' if len(users) == 1 else ''} the "
            f"data ({exc}), or {' and '.join(f for _, f in users)}"
        ) from exc


def effect_probe(
    args: argparse.Namespace,
    state: StateDir,
    settings: AggregatorSettings,
    valid: ByteSource | None = None,
) -> BlockProbe | None:
    """The probe on the validation split of --data (or $BLOCKTRAIN_DATA; `valid` when the
    caller read it already), unless it is off."""
    if settings.effect_probe == "off":
        return None
    if run_unit(state.run_config()) != "block":
        raise ConfigError(
            "a reference (DiLoCo) run takes --effect-probe off: the probe judges blocks"
        )
    return BlockProbe(
        RunConfig.from_dict(state.run_config()),
        valid if valid is not None else probe_data(args, settings),
        secret=secrets.randbits(62),  # drawn at each start, never stored nor served
    )


def live_evaluator(
    args: argparse.Namespace,
    state: StateDir,
    settings: AggregatorSettings,
    valid: ByteSource | None = None,
) -> AssembledEval | None:
    """The assembled model's validation CE on the first live_eval_bytes of the validation split
    (`valid` when the caller read it already), every live_eval_every rounds; None when that is 0."""
    if settings.live_eval_every == 0:
        return None
    return AssembledEval(
        RunConfig.from_dict(state.run_config()),
        run_unit(state.run_config()),
        valid if valid is not None else probe_data(args, settings),
        settings.live_eval_bytes,
        settings.live_eval_sweeps,
    )


def run(args: argparse.Namespace) -> int:
    """config -> state -> serve: the flags resolved once (`AggregatorSetup`), the state folder
    made or resumed from them (`prepare_state`), then the app served."""
    from blocktrain.listener import run as serve
    from blocktrain.protocol.http.app import create_app

    tls = tls_pair(args.tls_cert, args.tls_key)
    require_tls(args.host, tls, args.insecure_http)
    setup = AggregatorSetup.of(args)
    # Everything a start can fail on (the settings, the probe's data, the port) is checked
    # before the state folder is written, so that a failed first start leaves nothing behind
    # and the corrected command starts afresh; should anything fail after all, a state this
    # start created is removed again.
    root, fresh = setup.root, setup.config is not None  # fresh: a state this start creates
    before = {p.name for p in root.iterdir()} if root.is_dir() else None
    valid: list[ByteSource | None] = [None]
    listening: list[socket.socket] = []
    access: list[AccessLimits] = []

    def ready(settings: AggregatorSettings) -> None:
        access.append(access_limits(args, settings))  # a clear error before the state is touched
        if needs_data(settings):
            valid[0] = probe_data(args, settings)
        listening.append(bind(args.host, args.port))

    state: StateDir | None = None
    try:
        state, settings, directory = prepare_state(setup, ready)
        (limits,) = access
        app = create_app(
            settings,
            storage=state,
            limits=limits,
            probe=effect_probe(args, state, settings, valid[0]),
            directory=directory,
            evaluator=live_evaluator(args, state, settings, valid[0]),
        )
    except BaseException:
        for sock in listening:
            sock.close()
        if state is not None:
            state.close()
        if fresh:
            remove_new(root, before)
        raise
    (sock,) = listening
    url = url_of(sock, tls=tls is not None)
    # Every request allocates thousands of small objects, and each full collection walked the
    # whole heap torch and the app left at start-up: 18 % of the GIL's time under load
    # (py-spy --gil, bench/protocol_load.py). Frozen, those objects are never scanned again.
    gc.collect()
    gc.freeze()
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, and `serve` returns (listener.run): the
    # process exits 0 through the cleanup below.
    state.write_endpoint(url, os.getpid())
    print(
        f"aggregator for block(s) {','.join(map(str, directory.served))} of {state.n_blocks()} "
        f"listening on {url} (state {args.state})",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve(app, sock, limits.http, tls=tls, verbose=args.verbose)
    finally:
        state.clear_endpoint()
        state.close()
        sock.close()
    return 0
