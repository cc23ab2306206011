"""One block replica trained in memory, as a decentralised worker does; and the assembly of a
checkpoint from per-block weights, as the aggregator's export does.

A worker's batches come from its own data seed (`seed * n_workers + worker_id`: two replicas of a
block see different batches) and its step index from the version it trains from (version * H + i),
so that the learning-rate schedule follows the run's progress, not the worker's age. Its AdamW
state carries over from round to round while the weights are reset to each round's version."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.model import BlockStack, Reference, init_block, init_reference, target_table
from blocktrain.relaystream import RelayStream, Shape, StreamBody, StreamWriter
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.costs import stream_shape
from blocktrain.training.evaluate import (
    EvalSettings,
    Progress,
    evaluate_blocktrain,
    evaluate_reference,
)
from blocktrain.training.loss import BlockLoss, LossParts, Upstream, reference_loss
from blocktrain.training.optim import load_optimizer_tensors, make_optimizer, optimizer_tensors
from blocktrain.training.step import Objective, train_step

Tensors = dict[str, torch.Tensor]


class LocalBlockTrainer:
    """Block `block` of a run, its AdamW state, and the weights of the round it started from."""

    def __init__(
        self,
        cfg: RunConfig,
        block: int,
        data: ByteSource,
        *,
        data_seed: int,
        device: torch.device | str = "cpu",
        spool: Path | None = None,
    ) -> None:
        """`spool`: a folder for the relayed stream of a round as it is trained (`route =
        relay`; None: in memory)."""
        if not 0 <= block < cfg.model.blocks:
            raise ProtocolError(f"block {block} is outside 0..{cfg.model.blocks - 1}")
        self.cfg = cfg
        self.block_index = block
        self.data = data
        self.data_seed = data_seed
        self.device = torch.device(device)
        # route = features: the blocks before this one, frozen, refreshed each round
        self.upstream: BlockStack | None = None
        self.upstream_blocks: list[int] = []
        self._upstream_loaded = False
        # route = relay: the stream it trains on, and the one it writes for the next block
        relay = cfg.model.route == "relay"
        self.relays_from: int | None = block - 1 if relay and block > 0 else None
        self.relays_to: int | None = block + 1 if relay and block < cfg.model.blocks - 1 else None
        self.spool = spool
        self._stream: RelayStream | None = None
        self._relayed: torch.Tensor | None = None  # the features of the step being trained
        self._writer: StreamWriter | None = None
        self.module, self.objective = self._build()
        self.optimizer = make_optimizer(self.module, cfg.train)
        self.base: Tensors | None = None
        self.steps_done = 0

    def _build(self) -> tuple[torch.nn.Module, Objective]:
        cfg, block = self.cfg, self.block_index
        module = init_block(cfg.model, cfg.seed, block).to(self.device)
        targets = target_table(cfg.seed, cfg.model.d_model).to(self.device)
        if cfg.model.route == "features" and block > 0:
            self.upstream_blocks = list(range(block))
            self.upstream = BlockStack(cfg.model, cfg.seed, self.upstream_blocks).to(self.device)
            self.upstream.eval().requires_grad_(False)
        upstream: Upstream | None = None if self.upstream is None else self.upstream.upstream
        if self.relays_from is not None:
            upstream = self._relayed_features
        return module, functools.partial(BlockLoss(cfg.model, targets, upstream), module, block)

    def _relayed_features(self, _index: int, _x_bytes: torch.Tensor) -> torch.Tensor | None:
        return self._relayed

    def stream_shape(self) -> Shape:
        """What each step of this run's streams holds: N sequences of T bytes, d features."""
        return stream_shape(self.cfg)

    def load_stream(self, stream: RelayStream) -> None:
        """The stream of block `relays_from` this round trains on (route = relay)."""
        if self.relays_from is None:
            raise ProtocolError(f"block {self.block_index} trains on no relayed stream")
        if stream.info.shape != self.stream_shape():
            raise ProtocolError(
                f"a relayed stream of {stream.info.shape} does not fit this run's "
                f"{self.stream_shape()}"
            )
        self._stream = stream

    def stream_out(self, metadata: dict[str, str]) -> StreamBody | None:
        """The stream the last `train` wrote for block `relays_to` (None if it wrote none)."""
        writer, self._writer = self._writer, None
        if writer is None or writer.steps == 0:
            return None
        return writer.finish({"block": str(self.block_index), **metadata})

    def load(self, weights: Tensors) -> None:
        """Set the block's weights to a round's published version (names and shapes must match
        exactly); the optimizer state is kept."""
        _copy_weights(self.module, weights, self.block_index)
        self.base = {k: v.detach().float().clone() for k, v in self.module.state_dict().items()}

    def load_upstream(self, blocks: dict[int, Tensors]) -> None:
        """The versions of the blocks before this one that this round's features come from."""
        if sorted(blocks) != self.upstream_blocks:
            raise ProtocolError(
                f"block {self.block_index} reads blocks {self.upstream_blocks} upstream, "
                f"not {sorted(blocks)}"
            )
        if self.upstream is not None:
            for b, weights in blocks.items():
                _copy_weights(self.upstream.block(b), weights, b)
            self._upstream_loaded = True

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        """Up to `steps` AdamW updates at run steps first_step, first_step + 1, ... Returns the
        target bytes trained on ("tokens"), the mean loss and the steps done."""
        if self.upstream is not None and not self._upstream_loaded:
            raise ProtocolError(
                f"block {self.block_index} reads the clean streams of blocks "
                f"{self.upstream_blocks} (route = features): load_upstream() first"
            )
        stream, self._stream = self._stream, None
        if self.relays_from is not None and stream is None:
            raise ProtocolError(
                f"block {self.block_index} trains on block {self.relays_from}'s relayed stream "
                "(route = relay): load_stream() first"
            )
        if self.relays_to is not None:
            self._writer = StreamWriter(self.stream_shape(), self.spool)
        self.module.train()
        losses: list[float] = []
        tokens = 0
        every = self.cfg.train.relay_every  # each relayed step serves `every` steps
        for i in range(steps):
            if should_stop():
                break
            batch = None
            if stream is not None:  # the bytes and features block b-1 trained on and output
                batch, features = stream.step(i // every)
                self._relayed = features.to(self.device)
            result = train_step(
                self.module,
                self.optimizer,
                self.objective,
                self.data,
                self.cfg,
                seed=self.data_seed,
                unit=self.block_index,
                step=first_step + i,
                device=self.device,
                batch=batch,
            )
            if self._writer is not None and result.clean is not None and i % every == 0:
                self._writer.add(result.batch, result.clean)
            losses.append(result.logs["loss"])
            tokens += result.tokens
        self._relayed = None
        self.steps_done += len(losses)
        mean = sum(losses) / len(losses) if losses else math.nan
        return {"tokens": float(tokens), "loss": mean, "steps": float(len(losses))}

    def delta(self) -> Tensors:
        """theta_local - theta_base, fp32."""
        if self.base is None:
            raise ProtocolError("no weights loaded yet: call load() first")
        return {k: v.detach().float() - self.base[k] for k, v in self.module.state_dict().items()}

    def optimizer_state(self) -> Tensors:
        """The AdamW state as flat tensors (`NAME.step`, `NAME.exp_avg`, `NAME.exp_avg_sq` per
        parameter that has taken a step), for a worker's folder (`protocol.worker.resume`)."""
        return optimizer_tensors(self.optimizer, self.module, "")

    def load_optimizer_state(self, tensors: Tensors, steps_done: int = 0) -> None:
        """Carry on from a saved `optimizer_state` (a CheckpointError when it does not fit)."""
        load_optimizer_tensors(self.optimizer, self.module, "", tensors)
        self.steps_done = steps_done


class LocalReferenceTrainer(LocalBlockTrainer):
    """The end-to-end reference as one unit (unit 0) of a decentralised run: DiLoCo's replica
    (`simulate --set unit=reference`), the same rounds, averaging and outer optimizer as a block."""

    def _build(self) -> tuple[torch.nn.Module, Objective]:
        module = init_reference(self.cfg.model, self.cfg.seed).to(self.device)
        return module, functools.partial(_reference_objective, module)


def _reference_objective(model: Reference, x: torch.Tensor, _noise: torch.Generator) -> LossParts:
    return reference_loss(model, x)  # noiseless


def _copy_weights(module: torch.nn.Module, weights: Tensors, index: int) -> None:
    """Copy a published version into `module` in place; names and shapes must match exactly."""
    own = module.state_dict()
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or extra:
        raise ProtocolError(
            f"the aggregator's block {index} does not match this "
            f"model ({len(missing)} missing, {len(extra)} unexpected "
            f"tensors, e.g. {(missing or extra)[0]!r})"
        )
    with torch.no_grad():
        for name, value in weights.items():
            if value.shape != own[name].shape:
                raise ProtocolError(
                    f"{name} has shape {tuple(value.shape)}; this model's is "
                    f"{tuple(own[name].shape)}"
                )
            own[name].copy_(value)


def initial_blocks(cfg: RunConfig) -> dict[int, Tensors]:
    """Version 0 of every block: exactly what a worker's `init_block` builds."""
    return {b: init_block(cfg.model, cfg.seed, b).state_dict() for b in range(cfg.model.blocks)}


def initial_units(cfg: RunConfig, unit: str) -> dict[int, Tensors]:
    """Version 0 of a decentralised run's units: its blocks, or the reference as unit 0."""
    if unit == "reference":
        return {0: init_reference(cfg.model, cfg.seed).state_dict()}
    return initial_blocks(cfg)


def local_trainer(
    cfg: RunConfig,
    unit: str,
    index: int,
    data: ByteSource,
    *,
    data_seed: int,
    device: torch.device | str = "cpu",
    spool: Path | None = None,
) -> LocalBlockTrainer:
    """The trainer of one replica of unit `index`: a block's, or the reference's (DiLoCo);
    `spool`: where a relay block writes its round's stream (None: in memory)."""
    local = LocalReferenceTrainer if unit == "reference" else LocalBlockTrainer
    return local(cfg, index, data, data_seed=data_seed, device=device, spool=spool)


def reference_config(cfg: RunConfig) -> RunConfig:
    """A reference unit's run config: one unit, the whole `layers` deep."""
    if cfg.model.blocks == 1:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, blocks=1))


def reference_tensors(cfg: RunConfig, weights: Tensors) -> Tensors:
    """A reference unit's weights as a run folder names them ("reference.*", fp32), checked
    against the model `cfg` builds."""
    model = init_reference(cfg.model, cfg.seed)
    ckpt.load_module_tensors(
        model,
        {f"reference.{k}": v.float() for k, v in weights.items()},
        "reference.",
        Path("<reference>"),
    )
    return {f"reference.{k}": v for k, v in model.state_dict().items()}


def write_reference(run_dir: Path, cfg: RunConfig, weights: Tensors, step: int) -> None:
    """A reference run folder (`train --reference`'s layout) from a reference unit's weights,
    for eval and generate."""
    tensors = reference_tensors(cfg, weights)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.write_config(run_dir, ckpt.RunInfo(cfg, "reference", []))
    ckpt.atomic_save_tensors(
        run_dir / ckpt.MODEL_FILE,
        tensors,
        {"format": ckpt.FORMAT, "kind": "reference", "step": str(step)},
    )


def build_stack(cfg: RunConfig, blocks: dict[int, Tensors]) -> BlockStack:
    """The assembled model (eval mode) from per-block weights."""
    if sorted(blocks) != list(range(cfg.model.blocks)):
        raise CheckpointError(
            f"weights for blocks {sorted(blocks)} do not assemble the "
            f"{cfg.model.blocks}-block model"
        )
    stack = BlockStack(cfg.model, cfg.seed)
    for b, weights in blocks.items():
        ckpt.load_module_tensors(
            stack.block(b),
            {f"block.{b}.{k}": v.float() for k, v in weights.items()},
            f"block.{b}.",
            Path(f"<block {b}>"),
        )
    return stack.eval()


def evaluate_units(
    cfg: RunConfig,
    unit: str,
    weights: dict[int, Tensors],
    windows: torch.Tensor,
    settings: EvalSettings,
    progress: Progress | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """The assembled stack's metrics, or a reference unit's exact CE as both of its CEs: what
    `blocktrain cluster` and the aggregator's live evaluation score each round's model with."""
    if unit == "reference":
        model = init_reference(cfg.model, cfg.seed).eval()
        model.load_state_dict({k: v.float() for k, v in weights[0].items()})
        model = model.to(device)
        ev = evaluate_reference(model, windows, settings, progress)
        return {**ev, "from_noise_ce": ev["ce"], "sampler_ce": ev["ce"]}  # no sweeps: exact
    return evaluate_blocktrain(build_stack(cfg, weights).to(device), windows, settings, progress)


def assembled_tensors(cfg: RunConfig, blocks: dict[int, Tensors]) -> Tensors:
    """Per-block weights as a run folder names them: "block.{b}.*" and the target table
    "targets", checked by assembling the model."""
    stack = build_stack(cfg, blocks)
    weights: Tensors = {}
    for b in range(cfg.model.blocks):
        weights.update({f"block.{b}.{k}": v for k, v in stack.block(b).state_dict().items()})
    weights["targets"] = stack.targets
    return weights


def write_assembled(run_dir: Path, cfg: RunConfig, blocks: dict[int, Tensors], step: int) -> None:
    """A run folder that `load_model`, `blocktrain eval` and `generate` read: config.json of
    kind blocktrain with every block, and model.safetensors with block.{b}.* and targets."""
    weights = assembled_tensors(cfg, blocks)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.write_config(run_dir, ckpt.RunInfo(cfg, "blocktrain", list(range(cfg.model.blocks))))
    ckpt.atomic_save_tensors(
        run_dir / ckpt.MODEL_FILE,
        weights,
        {"format": ckpt.FORMAT, "kind": "blocktrain", "step": str(step)},
    )
