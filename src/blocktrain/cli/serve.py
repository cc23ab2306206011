"""`blocktrain serve`: the router in front of a chain of block hosts, with BlockTrain's own
`POST /v1/generate`, OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`
(streaming or not; `stop`, `n`, per-byte `logprobs`, `echo`, `seed`, `user`), `GET /readyz` (a
1-byte sweep through every host) and `GET /healthz`, so the official `openai` client works
against it unchanged. A BlockTrain model generates a span of K
bytes per traversal of the chain (one sweep); a reference model one byte per traversal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

from blocktrain.cli.common import (
    Formatter,
    add_named_sets,
    add_pattern_args,
    add_tls_args,
    file_patterns,
    split_sets,
)
from blocktrain.data import load_split
from blocktrain.data.ngram import NgramDrafter
from blocktrain.errors import ConfigError
from blocktrain.listener import bind, run, url_of
from blocktrain.model import Reference
from blocktrain.model.speculative import Drafter, ModelDrafter
from blocktrain.serving.openai.router_app import create_app
from blocktrain.serving.router.client_tokens import load_tokens
from blocktrain.serving.router.router_settings import FLAGS, RouterSettings
from blocktrain.serving.shared.auth import SECRET_ENV, load_secret
from blocktrain.tls import is_loopback, require_tls, tls_pair
from blocktrain.training.checkpoint import load_model

EXAMPLES = """examples:
  blocktrain serve --hosts http://127.0.0.1:8101,http://127.0.0.1:8102,http://127.0.0.1:8103 \\
      --port 8100
  curl -s localhost:8100/v1/completions -H 'content-type: application/json' \\
      -d '{"model": "tiny", "prompt": "The ", "max_tokens": 64, "seed": 1}'

  # two replicas of block 1: a request whose replica dies mid-stream goes on on the other
  blocktrain serve --hosts 'http://127.0.0.1:8101,http://127.0.0.1:8102|http://127.0.0.1:8112,http://127.0.0.1:8103' \\
      --port 8100
  curl -s localhost:8100/readyz    # 200 once a 1-byte sweep gets through every host

  # speculative generation with a K = 1 model: 6 bytes drafted per traversal, then verified
  blocktrain serve --hosts ... --port 8100 --draft-corpus data/wikitext-2
  curl -s localhost:8100/v1/generate -H 'content-type: application/json' \\
      -d '{"model": "tiny", "prompt": "The ", "max_bytes": 64, "draft_bytes": 6}'
  # ... drafted by a small autoregressive model on the router (a --reference run), each
  # verify sweep 8 noise draws (default 4): more bytes accepted per traversal
  blocktrain serve --hosts ... --port 8100 --draft-model runs/drafter
  curl -s localhost:8100/v1/generate -H 'content-type: application/json' \\
      -d '{"model": "tiny", "prompt": "The ", "max_bytes": 64, "draft_bytes": 12, "verify_draws": 8}'
  # ... every request that leaves draft_bytes out drafts 16 (the frontier's fastest recipe
  # with a drafter distilled by `blocktrain distill`); "draft_bytes": 0 opts out
  blocktrain serve --hosts ... --port 8100 --draft-model runs/drafter-kd --draft-bytes 16

  # hosts off loopback: the router presents their shared secret; limits per client and request
  blocktrain serve --hosts http://10.0.0.5:8101,http://10.0.0.6:8101 --port 8100 \\
      --secret-file serve.secret --rate-limit 30 --set max_work=2048
  # expert limits and timeouts by name (docs/serving.md, Settings)
  blocktrain serve --hosts ... --port 8100 --set timeout_s=60 wire_dtype=fp16 max_output_bytes=1024
  # only clients holding a token (one a line; the openai client sends it as its api_key)
  openssl rand -hex 32 > clients.tokens
  blocktrain serve --hosts ... --port 8100 --set tokens_file=clients.tokens
  # hosts on HTTPS with a self-signed certificate: trust it
  blocktrain serve --hosts https://10.0.0.5:8101 --port 8100 --secret-file serve.secret \\
      --set ca_cert=tls/cert.pem

  # the openai client, unchanged
  python -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:8100/v1', api_key='x');
  print(c.completions.create(model='tiny', prompt='The ', max_tokens=64).choices[0].text)"
  curl -s localhost:8100/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "stop": ["."]}'
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="route generation requests along a chain of block hosts",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument(
        "--hosts",
        required=True,
        metavar="URL,URL,...",
        help="the block hosts, in chain order; replicas of one position as URL|URL (a failed "
        "replica's work goes to another)",
    )
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--rate-limit",
        type=int,
        default=RouterSettings.rate_per_minute,
        metavar="N",
        help="generation requests a minute per client address (429 above; 0: no limit)",
    )
    add_tls_args(p)
    p.add_argument(
        "--secret-file",
        metavar="PATH",
        help=f"file holding the secret shared with the block hosts (else ${SECRET_ENV})",
    )
    p.add_argument(
        "--draft-corpus",
        metavar="PATH",
        help="a corpus (folder or file) whose train split builds the byte n-gram drafter for "
        "speculative generation (requests' draft_bytes, K = 1 models)",
    )
    add_pattern_args(p, of="--draft-corpus")
    p.add_argument(
        "--draft-model",
        metavar="RUN",
        help="a trained --reference run folder: a small autoregressive byte model on the router "
        "as the drafter (instead of --draft-corpus)",
    )
    p.add_argument(
        "--draft-bytes",
        type=int,
        default=0,
        help="draft_bytes of the requests that leave it out, for K = 1 and autoregressive "
        "models when no logprobs are asked (needs a drafter; 0: requests opt in). Long drafts "
        "pay with slow hops and a distilled drafter, short ones (4-8) or none on one loaded "
        "machine: docs/serving.md, Which D to pick",
    )
    add_named_sets(p, RouterSettings, FLAGS, own={"tokens_file": str})
    p.set_defaults(handler=run_cmd, server=True)  # runtime.serve_from_heap


def model_drafter(run: Path) -> ModelDrafter:
    """The drafter of --draft-model: a trained autoregressive run, on the router's CPU."""
    if not (run / "config.json").exists():
        raise ConfigError(f"--draft-model {run} is not a run folder (no config.json)")
    _, model = load_model(run)
    if not isinstance(model, Reference):
        raise ConfigError(f"--draft-model {run} is a BlockTrain run; it takes a --reference one")
    return ModelDrafter(model)


def run_cmd(args: argparse.Namespace) -> int:
    tls = tls_pair(args.tls_cert, args.tls_key)
    require_tls(args.host, tls, args.insecure_http)  # before a drafter takes its time to load
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
    drafter: Drafter | None = None
    sets = split_sets(args)[1]
    tokens_file = sets.pop("tokens_file", None)  # the file `tokens` is read from (none: no tokens)
    if args.draft_corpus and args.draft_model:
        raise ConfigError("give --draft-corpus or --draft-model, not both")
    if args.draft_model:
        drafter = model_drafter(Path(args.draft_model))
    if args.draft_corpus:
        if not Path(args.draft_corpus).exists():
            raise ConfigError(f"--draft-corpus {args.draft_corpus} does not exist")
        try:
            drafter = NgramDrafter(
                load_split(args.draft_corpus, "train", file_patterns(args)).read(),
                sets.get("draft_order", RouterSettings.draft_order),
            )
        except ValueError as exc:
            raise ConfigError(f"--draft-corpus {args.draft_corpus}: {exc}") from None
    settings = RouterSettings(
        drafter=drafter,
        draft_bytes=args.draft_bytes,
        hosts=hosts,
        rate_per_minute=args.rate_limit,
        secret=load_secret(args.secret_file),
        tokens=load_tokens(tokens_file),
        **sets,
    )
    sock = bind(args.host, args.port)
    app = create_app(settings)  # builds nothing that can fail: hosts are asked lazily
    print(f"routing to {', '.join(hosts)} on {url_of(sock, tls=tls is not None)}", flush=True)
    urls = [u for position in settings.positions for u in position]
    remote = [h for h in urls if not is_loopback(httpx.URL(h).host)]
    if settings.secret is None and remote:
        print(
            f"no secret: hosts off loopback ({', '.join(remote)}) will refuse this router",
            file=sys.stderr,
            flush=True,
        )
    print("press Ctrl+C to stop", file=sys.stderr, flush=True)
    run(app, sock, tls=tls)
    return 0
