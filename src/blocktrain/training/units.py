"""What a run trains: its units, each an independently optimised piece (a block, or the whole
reference) with its own AdamW and its own loss on a batch. Under `route = features` a run of some
blocks also holds, frozen, the blocks before them that they read (UPSTREAM_FILE)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from blocktrain.errors import ConfigError
from blocktrain.model import BlockStack, Reference, init_reference
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.distill import Teacher, TeacherSpec, distill_loss
from blocktrain.training.loss import BlockLoss, LossParts, reference_loss
from blocktrain.training.optim import make_optimizer
from blocktrain.training.step import Objective

REFERENCE_UNIT = 0  # the reference draws the same batch stream as block 0


@dataclass
class Unit:
    """One independently optimised piece: a block, or the whole reference."""

    name: str  # tensor-name prefix in the checkpoint: "block.{b}." or "reference."
    index: int  # the block index (REFERENCE_UNIT for the reference)
    module: nn.Module
    optimizer: torch.optim.AdamW = field(repr=False)
    objective: Objective = field(repr=False)  # the unit's loss on a batch


class Relay:
    """What a block reads upstream under `route = relay` in one process: block b-1's clean
    output of this step when this run trains block b-1 too (`Trainer.train_step` leaves it
    in `features`: what block b-1's replica relays), else the chain of the frozen blocks
    before it (`BlockStack.upstream`, as under `features`)."""

    def __init__(self, stack: BlockStack) -> None:
        self.stack = stack
        self.features: dict[int, torch.Tensor] = {}
        """block -> the features it reads at this step."""

    def __call__(self, index: int, x_bytes: torch.Tensor) -> torch.Tensor | None:
        relayed = self.features.get(index)
        return self.stack.upstream(index, x_bytes) if relayed is None else relayed


@dataclass
class RunUnits:
    units: list[Unit]
    stack: BlockStack | None = None  # a BlockTrain run's blocks, trained and frozen
    reference: Reference | None = None
    relay: Relay | None = None  # route = relay: the features passed down within a step


def build_units(
    info: ckpt.RunInfo,
    run_dir: Path,
    device: torch.device,
    teacher: TeacherSpec | None = None,
    upstream: dict[str, torch.Tensor] | None = None,
) -> RunUnits:
    """The units of the run `info` describes, on `device`. `upstream`: under `route =
    features`, the weights of the blocks that the trained ones read but the run does not hold
    (else read from the run's UPSTREAM_FILE)."""
    cfg, mcfg = info.config, info.config.model
    if teacher is not None and info.kind != "reference":
        raise ConfigError("only an autoregressive (reference) run distils from a teacher")
    if info.kind == "reference":
        reference = init_reference(mcfg, cfg.seed).to(device)
        law = None if teacher is None else Teacher(teacher, mcfg.seq_len, device)

        def objective(x: torch.Tensor, noise: torch.Generator) -> LossParts:
            if law is None:
                return reference_loss(reference, x)  # noiseless
            return distill_loss(reference, law, x, noise)

        unit = Unit(
            "reference.", REFERENCE_UNIT, reference, make_optimizer(reference, cfg.train), objective
        )
        return RunUnits([unit], reference=reference)
    held = info.blocks
    frozen = ckpt.upstream_blocks(cfg, held)
    stack = BlockStack(mcfg, cfg.seed, sorted(held + frozen)).to(device)
    if frozen:
        freeze_upstream(stack, frozen, held, run_dir / ckpt.UPSTREAM_FILE, upstream)
    relay = Relay(stack) if mcfg.route == "relay" else None
    loss = BlockLoss(mcfg, stack.targets, stack.upstream if relay is None else relay)
    units = [
        Unit(
            f"block.{b}.",
            b,
            stack.block(b),
            make_optimizer(stack.block(b), cfg.train),
            functools.partial(loss, stack.block(b), b),
        )
        for b in held
    ]
    return RunUnits(units, stack=stack, relay=relay)


def freeze_upstream(
    stack: BlockStack,
    frozen: list[int],
    held: list[int],
    path: Path,
    weights: dict[str, torch.Tensor] | None,
) -> None:
    """Load blocks `frozen` (read upstream by blocks `held`, never trained here) from `weights`,
    else from `path`, and freeze them."""
    if weights is None:
        if not path.is_file():
            raise ConfigError(
                f"blocks {held} of a route = features run read the clean streams of block(s) "
                f"{frozen} before them: give --upstream RUN_DIR, a run folder holding those (e.g. "
                "`train --block 0`), or train them together"
            )
        weights, _ = ckpt.load_tensors(path)
    for b in frozen:
        block = stack.block(b)
        ckpt.load_module_tensors(block, weights, f"block.{b}.", path)
        block.eval().requires_grad_(False)
