"""Small helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from tqdm import tqdm

from blocktrain.config import RunConfig, apply_overrides, parse_value, settable_keys, unknown_key
from blocktrain.data import FilePatterns
from blocktrain.device import DEVICE_HELP
from blocktrain.errors import ConfigError
from blocktrain.presets import PRESETS, preset
from blocktrain.protocol.core.settings import AggregatorSettings, declared, default_text
from blocktrain.serving.shared.declared import set_keys
from blocktrain.training.tracking import check_backends, parse_backends

TOKEN_ENV = "BLOCKTRAIN_TOKEN"
"""Where `worker` and `status` read the token when neither --token-file nor --token is given."""


def add_token_args(parser: argparse.ArgumentParser, what: str = "bearer token") -> None:
    """--token-file and --token; `resolve_token` reads them, then $BLOCKTRAIN_TOKEN."""
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"read the {what} from this file (its first line; keep it mode 600)",
    )
    parser.add_argument(
        "--token",
        help=f"the {what} itself; it shows in `ps`: prefer --token-file or ${TOKEN_ENV}",
    )


def resolve_token(args: argparse.Namespace) -> str:
    """The token from --token-file, --token or $BLOCKTRAIN_TOKEN (in that order); a warning
    on stderr for --token, which any local user can read in the process list."""
    if args.token_file and args.token:
        raise ConfigError("give --token-file or --token, not both")
    if args.token_file:
        try:
            lines = Path(args.token_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --token-file {args.token_file}: {exc}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise ConfigError(f"--token-file {args.token_file} is empty")
        return token
    if args.token:
        print(
            f"blocktrain: warning: --token shows in `ps`; use --token-file or ${TOKEN_ENV}",
            file=sys.stderr,
        )
        return str(args.token)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ConfigError(
            f"no token: pass --token-file PATH or set {TOKEN_ENV} (create one with "
            "`blocktrain token add --state DIR --name NAME`)"
        )
    return token


def add_ca_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ca-cert",
        "--ca-file",
        dest="ca_cert",
        metavar="PEM",
        help="trust this CA (or self-signed certificate) for an https aggregator",
    )


def checked_ca(args: argparse.Namespace) -> str | bool:
    """What `AggregatorClient(verify=...)` takes: the --ca-cert file, or the system's CAs."""
    if args.ca_cert and not Path(args.ca_cert).is_file():
        raise ConfigError(f"--ca-cert {args.ca_cert} does not exist")
    return str(args.ca_cert) if args.ca_cert else True


def add_tls_args(parser: argparse.ArgumentParser, public: bool = True) -> None:
    """--tls-cert/--tls-key; and, for a server that holds tokens (`public`), --insecure-http:
    such a server refuses plain HTTP off loopback without it (tls.require_tls)."""
    parser.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="... and this private key")
    if public:
        parser.add_argument(
            "--insecure-http",
            action="store_true",
            help="serve plain HTTP on a --host other machines reach (refused otherwise: tokens "
            "would cross the network in the clear); for TLS ended by a reverse proxy, or a "
            "private network",
        )


def add_config_args(parser: argparse.ArgumentParser, own: dict[str, type] | None = None) -> None:
    """--preset and --set; `own`: the command's own settings --set takes (name -> value type)."""
    if own:
        parser.set_defaults(setting_names=tuple(own), own_settings=own)
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="named configuration to start from",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        nargs="+",
        default=[],
        action="extend",
        help="override a config field, e.g. --set d_model=256 lr=1e-3; on the commands that run "
        "the protocol, an aggregator setting too, by its name: --set probe_gain_z=6 (the table "
        "in docs/protocol.md, Settings)"
        + (f"; this command's own: {', '.join(own)}" if own else ""),
    )


def add_unit_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reference",
        action="store_true",
        help="DiLoCo: every worker trains a replica of the end-to-end reference of `layers` "
        "layers instead of a block (with --outer-lr 0.7 --outer-momentum 0.9 as DiLoCo's "
        "outer Nesterov; the effect probe off)",
    )


def unit_of(args: argparse.Namespace) -> str:
    """The unit a new decentralised run's workers train (protocol.core.local_trainer.UNITS)."""
    return "reference" if getattr(args, "reference", False) else "block"


def split_sets(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The --set items: the config's KEY=VALUE strings (for `apply_overrides`), and the values of
    the settings named, by field name, on a command that takes them. A key that is neither fails
    with the nearest valid keys, or why the command refuses it (`set_refused`)."""
    names: tuple[str, ...] = getattr(args, "setting_names", ())
    config_keys = settable_keys() if hasattr(args, "preset") else []
    hints = typing.get_type_hints(getattr(args, "settings_class", AggregatorSettings))
    hints.update(getattr(args, "own_settings", {}))
    refused: dict[str, str] = getattr(args, "set_refused", {})
    config: list[str] = []
    settings: dict[str, Any] = {}
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        key, text = (part.strip() for part in item.split("=", 1))
        short = key.split(".", 1)[1] if key.startswith(("model.", "train.")) else key
        if key in names:
            settings[key] = parse_value(key, text, hints[key])
        elif short in config_keys:
            config.append(item)
        elif key in refused:
            raise ConfigError(f"--set {key}: {refused[key]}")
        else:
            raise ConfigError(unknown_key(key, [*config_keys, *names]))
    return config, settings


def add_named_sets(
    p: argparse.ArgumentParser,
    cls: type,
    flags: dict[str, str],
    where: str = "docs/serving.md, Settings",
    names: tuple[str, ...] | None = None,
    own: dict[str, type] | None = None,
) -> None:
    """--set NAME=VALUE for the fields of the settings class `cls` that have no flag in `flags`
    (`names`: only these); `--set` of a field in `flags` names its flag. `where`: the table that
    documents them. `own`: the command's own settings --set takes (name -> value type)."""
    own = own or {}
    names = (*(set_keys(cls, flags) if names is None else names), *own)
    refused = {name: f"give {flag}" for name, flag in flags.items()}
    p.set_defaults(setting_names=names, settings_class=cls, set_refused=refused, own_settings=own)
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="NAME=VALUE",
        nargs="+",
        default=[],
        action="extend",
        help=f"an expert setting by its name ({where}): {', '.join(names)}",
    )


def resolve_config(args: argparse.Namespace, sets: list[str] | None = None) -> RunConfig:
    """A command's run: its --preset, then the config keys of --set (`sets`, when the caller
    split them already), then --seed, --steps and --device."""
    sets = split_sets(args)[0] if sets is None else sets
    cfg = apply_overrides(preset(args.preset), sets)
    given = [(key, getattr(args, key, None)) for key in ("seed", "steps", "device")]
    return apply_overrides(cfg, [f"{key}={value}" for key, value in given if value is not None])


def add_device_arg(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """--device; `default` None: the run config's `device` (which train's --device overrides)."""
    parser.add_argument(
        "--device",
        default=default,
        metavar="DEVICE",
        help=DEVICE_HELP + ("" if default else " (default: the config's device, auto)"),
    )


def _thread_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count (0: torch's choice)")
    return n


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """--threads N (0, the default: torch's choice, every core); `use_threads` applies it."""
    parser.add_argument(
        "--threads",
        type=_thread_count,
        default=0,
        metavar="N",
        help="torch CPU threads (0: torch's choice, every core)",
    )


def use_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch  # here: `--help` and the commands without torch start faster

        torch.set_num_threads(args.threads)


def resolve_rounds_config(args: argparse.Namespace, local_steps: int) -> RunConfig:
    """The config of a run of `args.rounds` rounds of H local steps: unless --set gives
    `steps`, the learning-rate schedule spans the run (round r runs steps r*H .. r*H + H - 1)."""
    sets = split_sets(args)[0]
    cfg = resolve_config(args, sets)
    if not any(item.split("=", 1)[0].strip() in ("steps", "train.steps") for item in sets):
        cfg = apply_overrides(cfg, [f"steps={args.rounds * local_steps}"])
    return cfg


def add_setting_args(
    parser: argparse.ArgumentParser,
    title: str = "protocol settings (saved in the state folder)",
    *,
    simulated_only: bool = False,
    defaults: dict[str, Any] | None = None,
    own: dict[str, type] | None = None,
    own_doc: str = "",
) -> None:
    """Every `AggregatorSettings` field as `--set NAME=VALUE` and a flag for those declared with
    one; an absent flag leaves no attribute. `defaults`: the command's own, as its help shows them.
    `own`: the command's own settings --set takes (name -> value type), documented in `own_doc`.
    """
    defaults = defaults or {}
    own = own or {}
    chosen = [(f, s) for f, s in declared() if s.simulated or not simulated_only]
    refused = {f.name: "the simulator does not model this setting" for f, _ in declared()}
    names = (*(f.name for f, _ in chosen), *own)
    parser.set_defaults(setting_names=names, set_refused=refused, own_settings=own)
    also = f"; and this command's own ({own_doc}): {', '.join(own)}" if own else ""
    group = parser.add_argument_group(
        title,
        "every setting is also --set NAME=VALUE; these have no flag of their own (docs/"
        "protocol.md, Settings): " + ", ".join(f.name for f, s in chosen if not s.flag) + also,
    )
    group.argument_default = argparse.SUPPRESS
    hints = typing.get_type_hints(AggregatorSettings)
    for f, s in chosen:
        if not s.flag:
            continue
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None: the flag takes an X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        group.add_argument(
            s.flag,
            dest=f.name,
            type=kind,
            choices=s.choices,
            metavar=s.metavar,
            help=f"{s.doc} (default: {defaults.get(f.name, default_text(f, s))})".replace(
                "%", "%%"
            ),
        )


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given, by field name: --set NAME=VALUE or the setting's flag (not both)."""
    given = split_sets(args)[1]
    for f, s in declared():
        if hasattr(args, f.name):
            if f.name in given:
                raise ConfigError(f"give {s.flag} or --set {f.name}=..., not both")
            given[f.name] = getattr(args, f.name)
    return given


def add_data_arg(parser: argparse.ArgumentParser) -> None:
    """--data, and the --glob patterns that choose a folder's files."""
    parser.add_argument(
        "--data",
        metavar="PATH",
        help="a WikiText raw folder, a text file or a folder of text files, or hf:NAME[:CONFIG] "
        "/ hf:PATH for a Hugging Face dataset (hf:...#FIELD: its text column, default text), "
        "see `blocktrain data --help` (default: $BLOCKTRAIN_DATA)",
    )
    add_pattern_args(parser)


def add_pattern_args(parser: argparse.ArgumentParser, of: str = "--data") -> None:
    """--glob (repeatable), read by `file_patterns`."""
    parser.add_argument(
        "--glob",
        metavar="GLOB",
        action="append",
        help=f"read only the files of the {of} folder that match (repeatable), and none that "
        "match a !GLOB (which wins); a glob on the path from the folder: '*.txt' matches a name "
        "at any depth, 'docs/**/*.md' a path, ** any folders, e.g. --glob '*.py' --glob "
        "'!build/**' (default: every file)",
    )


def file_patterns(args: argparse.Namespace) -> FilePatterns:
    """The --glob patterns given: GLOB includes, !GLOB excludes (none: every file)."""
    globs = getattr(args, "glob", None) or ()
    return FilePatterns(
        tuple(g for g in globs if not g.startswith("!")),
        tuple(g[1:] for g in globs if g.startswith("!")),
    )


def add_log_arg(
    parser: argparse.ArgumentParser,
    what: str = "what metrics.jsonl gets",
    folder: str = "RUN_DIR",
    where: str = "the run folder",
) -> None:
    """--log-to: experiment loggers (training/tracking.py) fed by the records the command
    writes or prints (`what`), under `folder`; `log_backends` reads it."""
    parser.add_argument(
        "--log-to",
        metavar="BACKEND",
        action="append",
        help=f"also log {what} to tensorboard, wandb or mlflow (repeatable, or "
        f"comma-separated), offline under {where}: {folder}/tensorboard/ event files, an "
        f"offline W&B run in {folder}/wandb/ (WANDB_MODE=online to upload), an MLflow file "
        f"store in {folder}/mlruns/ (or $MLFLOW_TRACKING_URI); a library that is missing stops "
        "the command before it writes anything, naming the pip command",
    )


def log_backends(args: argparse.Namespace) -> tuple[str, ...]:
    """The --log-to backends (repeatable, comma-separated), each library imported: an unknown
    backend or a missing library is one ConfigError line, before the command writes anything."""
    names = parse_backends(getattr(args, "log_to", None))
    check_backends(names)
    return names


def add_progress_arg(parser: argparse.ArgumentParser) -> None:
    """--quiet (alias --no-progress): no progress bar. Without it a bar is drawn on stderr
    only when stderr is a terminal (never into a log file or a pipe)."""
    parser.add_argument(
        "-q",
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress bar (there is none anyway when stderr is not a terminal)",
    )


def progress_bar(args: argparse.Namespace, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, off with --quiet or when stderr is not a terminal."""
    return tqdm(file=sys.stderr, disable=True if args.quiet else None, dynamic_ncols=True, **kwargs)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the examples' line breaks and show defaults, except the empty ones (None, False: an
    option left out, a flag not given), which say nothing a reader needs."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)
