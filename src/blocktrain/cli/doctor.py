"""`blocktrain doctor`: why this machine cannot train for an aggregator. One line per check:
URL, DNS, TCP, TLS, HTTP, version, token and clock (`protocol.worker.doctor`), the codecs the
run's bytes go through (pushes, pulls, relayed streams), then the device
(--device: its name, its memory, and whether the block a worker would train fits, by `blocktrain
plan`'s worker memory for the aggregator's run config); exit code 0 when every check passed, 1
when one failed."""

from __future__ import annotations

import argparse
from typing import Any

from blocktrain.cli.common import (
    Formatter,
    add_ca_arg,
    add_device_arg,
    add_token_args,
    checked_ca,
    resolve_token,
)
from blocktrain.config import RunConfig
from blocktrain.device import fit_verdict, resolve_device
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.store.state import run_unit
from blocktrain.protocol.worker.doctor import Check, diagnose
from blocktrain.training.costs import TRAINED_BYTES_PER_PARAM
from blocktrain.training.plan import plan, worker_state_bytes

CHECK_TIMEOUT_S = 5.0
"""Seconds each network check waits (`doctor --timeout`; `join` checks with it)."""

EXAMPLES = """examples:
  blocktrain doctor http://10.0.0.5:8470 --token-file ~/.blocktrain-token
  blocktrain doctor https://agg.example:8470 --ca-file tls/cert.pem   # without a token: no token check
  blocktrain doctor http://10.0.0.5:8470 --token-file token.txt --device cuda:1  # that GPU's fit
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check the way to an aggregator: DNS, TCP, TLS, version, token, clock",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    p.add_argument("url", metavar="URL", help="the aggregator's URL")
    add_token_args(p)
    add_ca_arg(p)
    p.add_argument(
        "--timeout", type=float, default=CHECK_TIMEOUT_S, metavar="S", help="per network step"
    )
    add_device_arg(p)
    p.set_defaults(handler=run)


def checks_for(args: argparse.Namespace) -> list[Check]:
    if args.timeout <= 0:
        raise ConfigError("--timeout must be positive")
    try:
        token: str | None = resolve_token(args)
    except ConfigError:
        if args.token_file or args.token:
            raise  # a token was given but cannot be read: say so
        token = None  # none anywhere: the token check is skipped
    configs: list[dict[str, Any]] = []
    checks = diagnose(
        args.url, token, verify=checked_ca(args), timeout_s=args.timeout, on_config=configs.append
    )
    run_config = configs[0].get("run_config") if configs else None
    device = device_check(args.device, run_config, getattr(args, "block", None))
    return [*checks, codecs_check(configs[0] if configs else None), device]


def codecs_check(config: dict[str, Any] | None) -> Check:
    """The codecs line: what the run's bytes go through (pushes, pulls, streams), from the
    aggregator's /v1/config; skipped without it (no token, or the token check failed)."""
    if config is None:
        return Check("codecs", None, "needs the run's config (the token check)")
    try:
        settings = AggregatorSettings.from_dict(dict(config["protocol"]))
        return Check("codecs", True, settings.codecs(dict(config["run_config"])))
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        return Check("codecs", False, f"the aggregator's settings do not parse here: {exc}")


def device_check(name: str, run_config: dict[str, Any] | None, block: int | None) -> Check:
    """The device line: `name` resolved (a missing one fails here), its memory, and whether the
    worker of `block` (None: the block the aggregator would choose, so the largest) fits."""
    try:
        device = resolve_device(name)
    except ConfigError as exc:
        return Check("device", False, str(exc))
    need, what = None, "the block's worker"
    if isinstance(run_config, dict):
        try:
            cfg = RunConfig.from_dict(run_config)
            if run_unit(run_config) == "reference":
                need = plan(cfg)["reference_params"] * TRAINED_BYTES_PER_PARAM
                what = "the reference's worker"
            else:
                per_block = worker_state_bytes(cfg)
                chosen = (
                    block
                    if block is not None and 0 <= block < len(per_block)
                    else max(range(len(per_block)), key=per_block.__getitem__)
                )
                need, what = per_block[chosen], f"block {chosen}'s worker"
                if block is None and len(set(per_block)) > 1:
                    what = f"the largest block's worker (block {chosen})"
        except (ConfigError, KeyError, TypeError, ValueError):
            need = None
    ok, detail = fit_verdict(device, need, what)
    return Check("device", ok, detail)


def run(args: argparse.Namespace) -> int:
    checks = checks_for(args)
    for check in checks:
        print(check.line())
    return 1 if any(c.ok is False for c in checks) else 0
