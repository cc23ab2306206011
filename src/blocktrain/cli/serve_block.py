"""`blocktrain serve-block`: serve some blocks of a run (and/or stages of a reference run) as one
host of a serving chain. Each request runs this host's sampler steps on a span's state and
answers the state for the next host to the router (or forwards it to its own --next, in a
chain without a router); the host of the last block answers the logits or bytes."""

from __future__ import annotations

import argparse
import sys

from blocktrain.cli.common import (
    Formatter,
    add_named_sets,
    add_threads_arg,
    add_tls_args,
    split_sets,
    use_threads,
)
from blocktrain.config import parse_blocks
from blocktrain.device import DEVICE_HELP, resolve_device
from blocktrain.errors import ConfigError
from blocktrain.listener import bind, run, url_of
from blocktrain.serving.host.host_app import create_app
from blocktrain.serving.host.host_settings import FLAGS, HostSettings
from blocktrain.serving.host.loading import ModelSource
from blocktrain.serving.shared.auth import SECRET_ENV, load_secret
from blocktrain.serving.shared.transport import check_url
from blocktrain.tls import is_loopback, tls_pair

EXAMPLES = """examples:
  # hosts take work only from a router holding the same secret (required off loopback)
  openssl rand -hex 32 > serve.secret
  blocktrain serve-block runs/tiny --blocks 0 --host 10.0.0.5 --port 8101 \\
      --secret-file serve.secret
  export BLOCKTRAIN_SERVE_SECRET=$(cat serve.secret)    # or from the environment

  # HTTPS, so that the secret never crosses the network in the clear
  blocktrain serve-block runs/tiny --blocks 0 --host 10.0.0.5 --port 8101 \\
      --secret-file serve.secret --tls-cert tls/cert.pem --tls-key tls/key.pem

  # on loopback the secret may be left out
  blocktrain serve-block runs/tiny --blocks 0 --port 8101 &
  blocktrain serve-block runs/tiny --blocks 1 --port 8102 &
  blocktrain serve-block runs/tiny --blocks 2 --port 8103 &
  blocktrain serve --hosts http://127.0.0.1:8101,http://127.0.0.1:8102,http://127.0.0.1:8103 \\
      --port 8100

  # the same hosts also serve the reference, split into as many stages (the AR baseline)
  blocktrain serve-block tiny=runs/tiny ref=runs/ref --blocks 0 --port 8101
  # batching (on by default): concurrent sweeps at the same point share a forward pass;
  # the oldest may wait 5 ms for company
  blocktrain serve-block runs/tiny --blocks 0 --port 8101 --batch-window-ms 5
  # each generation's clean stream is cached per block (on by default), within a memory cap
  blocktrain serve-block runs/tiny --blocks 0 --port 8101 --max-cache-mb 256
  blocktrain serve-block runs/tiny --blocks 0 --port 8101 --no-kv-cache
  # a replica of block 1 (name both in the router's --hosts: URL|URL)
  blocktrain serve-block runs/tiny --blocks 1 --port 8112
  # on a GPU (auto, the default, takes the first one torch sees)
  blocktrain serve-block runs/paper --blocks 0 --port 8101 --device cuda:0

  # expert limits, windows and caches by name (docs/serving.md, Settings)
  blocktrain serve-block runs/tiny --blocks 0 --port 8101 --set max_sessions=64 session_ttl_s=120
  blocktrain serve-block runs/tiny --blocks 0 --port 8101 --set public_url=https://h.example:8101

  # a chain without a router: forward to the next host yourself
  blocktrain serve-block runs/tiny --blocks 0 --port 8101 --next http://127.0.0.1:8102
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-block",
        help="serve some blocks of a run as one host of a chain",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument(
        "models",
        metavar="RUN_DIR",
        nargs="+",
        help="run folder to serve, or NAME=RUN_DIR (the model name defaults to the "
        "folder's name); a reference run is served as pipeline stages",
    )
    p.add_argument(
        "--blocks",
        required=True,
        metavar="B[,B..]",
        help="the blocks (or reference stages) this host holds, e.g. 0 or 1,2",
    )
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--next",
        dest="next_url",
        metavar="URL",
        help="next host of a chain without a router (hosts behind a router take none)",
    )
    add_tls_args(p, public=False)
    p.add_argument(
        "--secret-file",
        metavar="PATH",
        help=f"file holding the secret shared with the router (else ${SECRET_ENV}); "
        "required unless --host is a loopback address",
    )
    add_threads_arg(p)
    p.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help=DEVICE_HELP + " (or the port bound)",
    )
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=HostSettings.batch_window_ms,
        help="how long a sweep waits for concurrent ones to share its forward pass",
    )
    p.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="keep no clean-stream cache per generation: every sweep computes its whole "
        "context (the same results up to float rounding; e.g. to compare)",
    )
    p.add_argument(
        "--max-cache-mb",
        type=float,
        default=HostSettings.max_cache_bytes / 2**20,
        help="memory all kept caches may take (MiB); the least recently used generations "
        "are dropped past it",
    )
    add_named_sets(p, HostSettings, FLAGS)
    p.set_defaults(handler=run_cmd, server=True)  # runtime.serve_from_heap


def run_cmd(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)  # before any file is read or the port bound
    sources = tuple(ModelSource.parse(m) for m in args.models)
    parts = parse_blocks(args.blocks)
    next_url = check_url(args.next_url, "--next") if args.next_url else None
    if not args.max_cache_mb > 0:
        raise ConfigError(f"--max-cache-mb {args.max_cache_mb} must be positive")
    sets = split_sets(args)[1]
    use_threads(args)
    public = sets.pop("public_url", None)
    public = check_url(public, "--set public_url") if public else None
    secret = load_secret(args.secret_file)
    if secret is None and not is_loopback(args.host):
        raise ConfigError(
            f"a block host listening on {args.host} needs the secret it shares with the "
            f"router (--secret-file PATH or ${SECRET_ENV}); without it anyone who reaches "
            "the port could run work on it"
        )
    tls = tls_pair(args.tls_cert, args.tls_key)
    sock = bind(args.host, args.port)
    try:
        settings = HostSettings(
            models=sources,
            parts=parts,
            next_url=next_url,
            public_url=public or url_of(sock, tls=tls is not None),
            secret=secret,
            batch_window_ms=args.batch_window_ms,
            kv_cache=not args.no_kv_cache,
            max_cache_bytes=int(args.max_cache_mb * 2**20),
            device=device,
            **sets,
        )
        app = create_app(settings)  # loads this host's blocks: errors before we serve
    except BaseException:
        sock.close()
        raise
    url = settings.public_url
    names = ", ".join(f"{s.name} ({s.run_dir})" for s in sources)
    print(f"serving blocks {list(parts)} of {names} on {url}", flush=True)
    if secret is None:
        print("no secret: any local process may call this host", file=sys.stderr, flush=True)
    print("press Ctrl+C to stop", file=sys.stderr, flush=True)
    run(app, sock, tls=tls)
    return 0
