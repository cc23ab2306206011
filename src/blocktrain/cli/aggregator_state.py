"""The state folder of `blocktrain aggregator`: its flags resolved once (`AggregatorSetup`), the
folder created or resumed (`prepare_state`), every check against the saved blocks, peers and
the probe's reach before the first write, and a failed first start undone (`remove_new`), so
that the corrected command starts afresh."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blocktrain.cli.common import resolve_config, settings_overrides, split_sets, unit_of
from blocktrain.config import RunConfig, parse_blocks
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.bounds import derived_settings, largest_block
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.service.placement import Directory, parse_peer, placed
from blocktrain.protocol.store.state import create_state
from blocktrain.protocol.store.storage import StateDir
from blocktrain.serving.shared.transport import check_url
from blocktrain.training.local import initial_units, reference_config


@dataclass(frozen=True)
class AggregatorSetup:
    """What `blocktrain aggregator` was asked for, resolved once from its flags: the run of a new
    state (preset -> --set -> --seed) or none (a resumed state's own), the settings given, the
    blocks to serve and their peers."""

    root: Path
    config: RunConfig | None
    """A new state's run; None: resume the one the folder holds."""
    unit: str
    settings: dict[str, Any]
    served: tuple[int, ...] | None
    peers: dict[int, str]

    @classmethod
    def of(cls, args: argparse.Namespace) -> AggregatorSetup:
        """The setup from the flags, checked against the folder: a folder that holds a run
        takes no --preset, --seed or --set of a config key; an empty one needs --preset."""
        settings = settings_overrides(args)
        served = None if args.blocks is None else parse_blocks(args.blocks)
        peers = dict(parse_peer(text) for text in args.peer)
        for b, url in peers.items():  # saved in the state and handed to workers: checked first
            check_url(url, f"--peer {b}=URL")
        root = Path(args.state)
        unit = unit_of(args)
        if StateDir(root).initialised:
            if args.preset is not None or split_sets(args)[0] or args.seed is not None:
                raise ConfigError(
                    f"{args.state} already holds a run; omit --preset, --seed and --set of a "
                    "config key to resume it (--set of a setting replaces the saved one), or "
                    "choose a new --state"
                )
            return cls(root, None, unit, settings, served, peers)
        if args.preset is None:
            raise ConfigError(
                f"{args.state} holds no aggregator state yet: give --preset NAME to create one"
            )
        cfg = resolve_config(args)
        config = reference_config(cfg) if unit == "reference" else cfg
        return cls(root, config, unit, settings, served, peers)


def prepare_state(
    setup: AggregatorSetup, ready: Callable[[AggregatorSettings], None] | None = None
) -> tuple[StateDir, AggregatorSettings, Directory]:
    """The state folder (created from the setup's run, or resumed with its settings) and the
    directory of its blocks. `ready(settings)`, when given, runs after every check and before the
    first write: what it raises leaves the folder as it was."""
    overrides, served, peers = setup.settings, setup.served, setup.peers
    cfg = setup.config
    if cfg is None:
        state = StateDir(setup.root)
        settings = state.settings().replace(**overrides)
        saved = state.placement()[0]
        held = served if served is not None else saved or range(state.n_blocks())
        check_probe_reach(RunConfig.from_dict(state.run_config()).model.route, held, settings)
        check_eval_reach(held, state.n_blocks(), settings)
        if ready is not None:
            ready(settings)
        directory = placed(state, served, peers)
        if overrides:
            state.write_manifest(
                run_config=state.run_config(), settings=settings, n_blocks=state.n_blocks()
            )
        return state, settings, directory
    Directory.build(cfg.model.blocks, served, peers)  # a clear error before the state is made
    blocks = initial_units(cfg, setup.unit)
    settings = derived_settings(cfg, overrides, largest_block(blocks))
    check_probe_reach(cfg.model.route, served or range(cfg.model.blocks), settings)
    check_eval_reach(served or range(cfg.model.blocks), cfg.model.blocks, settings)
    if ready is not None:
        ready(settings)
    state = create_state(setup.root, cfg, overrides, blocks, setup.unit)
    return state, state.settings(), placed(state, served, peers)


def check_probe_reach(route: str, served: Iterable[int], settings: AggregatorSettings) -> None:
    """Under `route = features` the effect probe judges block b with the versions of blocks
    0..b-1 that its workers read: an aggregator serving b without them cannot run it (its
    workers can still read them, from their aggregators)."""
    held = set(served)
    elsewhere = sorted({u for b in held for u in range(b)} - held)
    if route != "state" and settings.effect_probe != "off" and elsewhere:
        raise ConfigError(
            f"route = {route}: the blocks served here read block(s) {elsewhere}, which another "
            "aggregator serves, and the effect probe judges a block with what it reads; serve "
            "those here too, or pass --effect-probe off"
        )


def check_eval_reach(served: Iterable[int], n_blocks: int, settings: AggregatorSettings) -> None:
    """live_eval_every evaluates the assembled model: an aggregator of some blocks cannot."""
    held = sorted(set(served))
    if settings.live_eval_every > 0 and held != list(range(n_blocks)):
        raise ConfigError(
            f"--set live_eval_every={settings.live_eval_every} evaluates the assembled model, and this "
            f"aggregator serves block(s) {held} of {n_blocks}: pass --set live_eval_every=0 here, or "
            "serve every block"
        )


def remove_new(root: Path, before: set[str] | None) -> None:
    """Undo a first start that failed after creating its state: remove `root` if it did not
    exist (`before` None), else the entries it did not hold."""
    if before is None:
        shutil.rmtree(root, ignore_errors=True)
        return
    for entry in root.iterdir():
        if entry.name not in before:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
