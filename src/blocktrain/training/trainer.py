"""The training loop: one chosen block (what a worker does), every block in turn (the
single-machine job), or the end-to-end reference. Each update is seeded by (seed, unit, step) and
the optimizer state is saved exactly, so a resumed run computes the same losses as an
uninterrupted one."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.device import resolve_device
from blocktrain.errors import CheckpointError, ConfigError
from blocktrain.model import BlockStack, Reference
from blocktrain.training import checkpoint as ckpt
from blocktrain.training.distill import DISTILL_FILE, TeacherSpec
from blocktrain.training.evaluate import (
    EvalSettings,
    evaluate_blocktrain,
    evaluate_oracle_block,
    evaluate_reference,
)
from blocktrain.training.optim import (
    learning_rate,
    load_optimizer_tensors,
    optimizer_tensors,
)
from blocktrain.training.step import precision_context, train_step
from blocktrain.training.tracking import Tracker, log_record
from blocktrain.training.units import Unit, build_units

log = logging.getLogger(__name__)


class Trainer:
    """Trains the units of one run folder. Build it with `Trainer.create` or `Trainer.resume`."""

    def __init__(
        self,
        info: ckpt.RunInfo,
        run_dir: Path,
        train: ByteSource,
        valid: ByteSource | None,
        teacher: TeacherSpec | None = None,
        upstream: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`upstream`: under `route = features`, the weights of the blocks before the trained
        ones that they read but this run does not hold (else read from UPSTREAM_FILE)."""
        self.info = info
        self.cfg: RunConfig = info.config
        self.run_dir = Path(run_dir)
        self.train_data = train
        self.valid_data = valid
        self.device = resolve_device(self.cfg.train.device)
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        self.step = 0
        self.bytes_seen = 0
        self.wall_seconds = 0.0
        self.last_eval: dict[str, Any] | None = None
        self.trackers: list[Tracker] = []
        """Experiment loggers (training/tracking.py) that get every metrics.jsonl record."""
        self.teacher = teacher
        built = build_units(info, self.run_dir, self.device, teacher, upstream)
        self.stack: BlockStack | None = built.stack
        self.reference: Reference | None = built.reference
        self.units: list[Unit] = built.units
        self.relay = built.relay

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        cfg: RunConfig,
        run_dir: Path,
        train: ByteSource,
        valid: ByteSource | None,
        *,
        kind: str = "blocktrain",
        blocks: list[int] | None = None,
        overwrite: bool = False,
        teacher: TeacherSpec | None = None,
        init_from: Path | None = None,
        upstream_from: list[Path] | None = None,
    ) -> Trainer:
        """A fresh run in `run_dir` (refused if it already holds one, unless `overwrite`);
        `teacher`: distil towards its law (training/distill.py) instead of the data;
        `init_from`: start from the weights of that run, of the same kind and model config;
        `upstream_from`: run folders holding the blocks that the trained ones read under
        `route = features` (copied into the run's UPSTREAM_FILE, frozen)."""
        run_dir = Path(run_dir)
        ckpt.check_run_dir_free(run_dir, overwrite=overwrite)
        if blocks is not None:
            for b in blocks:
                if not 0 <= b < cfg.model.blocks:
                    raise CheckpointError(f"--block {b} is outside 0..{cfg.model.blocks - 1}")
        info = ckpt.RunInfo(
            cfg,
            kind,
            []
            if kind == "reference"
            else sorted(blocks if blocks is not None else range(cfg.model.blocks)),
        )
        upstream = None
        if upstream_from:
            needed = ckpt.upstream_blocks(cfg, info.blocks)
            if not needed:
                raise ConfigError(
                    "--upstream gives the blocks a route = features run reads but does not "
                    f"train; blocks {info.blocks or kind} of route = {cfg.model.route} read none"
                )
            upstream = ckpt.gather_upstream([Path(p) for p in upstream_from], cfg, needed)
        trainer = cls(info, run_dir, train, valid, teacher, upstream)
        if init_from is not None:
            trainer._init_weights(Path(init_from))
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in (
            ckpt.MODEL_FILE,
            ckpt.OPTIMIZER_FILE,
            ckpt.STATE_FILE,
            ckpt.METRICS_FILE,
            ckpt.UPSTREAM_FILE,
            DISTILL_FILE,
        ):
            (run_dir / name).unlink(missing_ok=True)
        ckpt.write_config(run_dir, info)
        if upstream is not None:
            meta = {"format": ckpt.FORMAT, "kind": "upstream"}
            ckpt.atomic_save_tensors(run_dir / ckpt.UPSTREAM_FILE, upstream, meta)
        if teacher is not None:
            teacher.write(run_dir)
        return trainer

    def _init_weights(self, source: Path) -> None:
        """Load the weights of run `source` (its model config must equal this run's)."""
        theirs = ckpt.read_config(source)
        # A BlockTrain run's target table comes from its seed: weights of another seed's stack
        # would denoise towards other targets.
        other_seed = self.stack is not None and theirs.config.seed != self.cfg.seed
        if theirs.kind != self.info.kind or theirs.config.model != self.cfg.model or other_seed:
            raise ConfigError(
                f"{source} is a {theirs.kind} run of another model config or seed; a run starts only "
                f"from the weights of a {self.info.kind} run of its own"
            )
        weights, _ = ckpt.load_tensors(source / ckpt.MODEL_FILE)
        for unit in self.units:
            ckpt.load_module_tensors(unit.module, weights, unit.name, source / ckpt.MODEL_FILE)

    @classmethod
    def resume(
        cls,
        run_dir: Path,
        train: ByteSource,
        valid: ByteSource | None,
        *,
        steps: int | None = None,
        device: str | None = None,
    ) -> Trainer:
        """Continue the run in `run_dir` from its last checkpoint (optionally to a new total of
        `steps`, which changes the learning-rate schedule from here on, or on another
        `device`, checked before the config is rewritten)."""
        run_dir = Path(run_dir)
        info = ckpt.read_config(run_dir)
        changes: dict[str, Any] = {}
        if steps is not None and steps != info.config.train.steps:
            changes["steps"] = steps
        if device is not None and device != info.config.train.device:
            changes["device"] = device
        resolve_device(changes.get("device", info.config.train.device))
        if changes:
            import dataclasses

            info = ckpt.RunInfo(
                dataclasses.replace(
                    info.config, train=dataclasses.replace(info.config.train, **changes)
                ),
                info.kind,
                info.blocks,
            )
            ckpt.write_config(run_dir, info)
        trainer = cls(info, run_dir, train, valid, TeacherSpec.read(run_dir))
        trainer._load_checkpoint()
        return trainer

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> None:
        meta = {"format": ckpt.FORMAT, "kind": self.info.kind, "step": str(self.step)}
        weights: dict[str, torch.Tensor] = {}
        moments: dict[str, torch.Tensor] = {}
        for unit in self.units:
            weights.update({unit.name + k: v for k, v in unit.module.state_dict().items()})
            moments.update(optimizer_tensors(unit.optimizer, unit.module, unit.name))
        if self.stack is not None:
            weights["targets"] = self.stack.targets
        ckpt.atomic_save_tensors(self.run_dir / ckpt.MODEL_FILE, weights, meta)
        ckpt.atomic_save_tensors(self.run_dir / ckpt.OPTIMIZER_FILE, moments, meta)
        ckpt.write_state(
            self.run_dir,
            {"step": self.step, "bytes_seen": self.bytes_seen, "wall_seconds": self.wall_seconds},
        )

    def _load_checkpoint(self) -> None:
        state = ckpt.read_state(self.run_dir)
        weights, wmeta = ckpt.load_tensors(self.run_dir / ckpt.MODEL_FILE)
        moments, ometa = ckpt.load_tensors(self.run_dir / ckpt.OPTIMIZER_FILE)
        for meta, name in ((wmeta, ckpt.MODEL_FILE), (ometa, ckpt.OPTIMIZER_FILE)):
            if meta.get("format") != ckpt.FORMAT:
                raise CheckpointError(f"{self.run_dir / name} is not a BlockTrain file")
            if meta.get("step") != str(state["step"]):
                raise CheckpointError(
                    f"{self.run_dir}: {name} is from step {meta.get('step')} but state.json "
                    f"says {state['step']}; the checkpoint is inconsistent"
                )
        for unit in self.units:
            ckpt.load_module_tensors(
                unit.module, weights, unit.name, self.run_dir / ckpt.MODEL_FILE
            )
            load_optimizer_tensors(unit.optimizer, unit.module, unit.name, moments)
        if self.stack is not None and not torch.equal(
            weights.get("targets", torch.empty(0)), self.stack.targets.cpu()
        ):
            raise CheckpointError(
                f"{self.run_dir}: the target table does not match the run's "
                "seed; the checkpoint is foreign or corrupt"
            )
        self.step = int(state["step"])
        self.bytes_seen = int(state.get("bytes_seen", 0))
        self.wall_seconds = float(state.get("wall_seconds", 0.0))
        ckpt.truncate_metrics(self.run_dir, self.step)
        log.info("resumed %s at step %d", self.run_dir, self.step)

    # ---------------------------------------------------------------- the loop

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision context of this run's forward passes (bf16 autocast, or nothing)."""
        return precision_context(self.cfg.train.precision, self.device)

    def train_step(self) -> dict[str, float]:
        """One update of every unit at `self.step`; returns the merged logs. Each unit draws
        its own batch, but under `route = relay`: there the blocks train in order on the
        first one's batch, each reading the clean output its predecessor computed in its own
        update (what a decentralised replica relays), instead of re-running the blocks before."""
        logs: dict[str, float] = {"lr": learning_rate(self.step, self.cfg.train)}
        batch = None
        if self.relay is not None:
            self.relay.features.clear()
        for unit in self.units:
            result = train_step(
                unit.module,
                unit.optimizer,
                unit.objective,
                self.train_data,
                self.cfg,
                seed=self.cfg.seed,
                unit=unit.index,
                step=self.step,
                device=self.device,
                batch=batch,
            )
            if self.relay is not None:
                batch = result.batch
                if result.clean is not None:
                    self.relay.features[unit.index + 1] = result.clean
            self.bytes_seen += result.tokens
            prefix = "" if len(self.units) == 1 else f"b{unit.index}_"
            logs.update({prefix + k: v for k, v in result.logs.items()})
        if len(self.units) > 1:
            logs["loss"] = sum(logs[f"b{u.index}_loss"] for u in self.units) / len(self.units)
        return logs

    def evaluate(self, split: ByteSource, n_bytes: int, sweeps: int) -> dict[str, Any]:
        """The periodic evaluation: full metrics when all blocks are here, the block's oracle
        CE for a one-block run, plain CE for the reference."""
        windows = split.windows(self.cfg.model.seq_len, n_bytes)
        settings = EvalSettings(sweeps=sweeps, seed=self.cfg.seed)
        for unit in self.units:
            unit.module.eval()
        try:
            if self.reference is not None:
                return evaluate_reference(self.reference, windows, settings)
            assert self.stack is not None
            if self.info.blocks == list(range(self.cfg.model.blocks)):
                return evaluate_blocktrain(self.stack, windows, settings)
            return {  # the blocks trained here (the frozen upstream ones are not)
                f"block{b}": evaluate_oracle_block(self.stack, b, windows, settings)
                for b in self.info.blocks
            }
        finally:
            for unit in self.units:
                unit.module.train()

    def _append_metrics(self, record: dict[str, Any]) -> None:
        """The one metrics writer: a line of metrics.jsonl, and the same record to each
        experiment logger."""
        with open(self.run_dir / ckpt.METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        log_record(self.trackers, record)

    def run(self, *, progress: bool = True, until: int | None = None) -> dict[str, Any]:
        """Train until `train.steps` (or stop early at step `until`, keeping the schedule of the
        full run), logging, evaluating and checkpointing on the way; the last step reached is
        always checkpointed, so `resume` continues from it."""
        tcfg = self.cfg.train
        total = tcfg.steps
        stop = total if until is None else min(until, total)
        bar = tqdm(
            total=total,
            initial=self.step,
            disable=None if progress else True,
            unit="step",
            dynamic_ncols=True,
            desc=f"train {self._describe()}",
        )
        window_start, window_bytes = time.perf_counter(), 0
        started = time.perf_counter()
        wall_at_start = self.wall_seconds
        logs: dict[str, float] = {}
        for unit in self.units:
            unit.module.train()
        while self.step < stop:
            before = self.bytes_seen
            logs = self.train_step()
            self.step += 1
            window_bytes += self.bytes_seen - before
            self.wall_seconds = wall_at_start + time.perf_counter() - started
            if not all(math.isfinite(v) for v in logs.values()):
                raise FloatingPointError(f"non-finite loss at step {self.step}: {logs}")
            if self.step % max(1, tcfg.log_every) == 0 or self.step == total:
                elapsed = time.perf_counter() - window_start
                logs["bytes_per_s"] = window_bytes / max(elapsed, 1e-9)
                window_start, window_bytes = time.perf_counter(), 0
                self._append_metrics(
                    {
                        "event": "train",
                        "step": self.step,
                        "wall_seconds": round(self.wall_seconds, 3),
                        **logs,
                    }
                )
                bar.set_postfix(self._postfix(logs), refresh=False)
            if self.valid_data is not None and (
                (tcfg.eval_every and self.step % tcfg.eval_every == 0) or self.step == total
            ):
                self.last_eval = self.evaluate(self.valid_data, tcfg.eval_bytes, tcfg.eval_sweeps)
                self._append_metrics(
                    {"event": "eval", "split": "valid", "step": self.step, **self.last_eval}
                )
                bar.set_postfix(self._postfix(logs), refresh=False)
            if (
                tcfg.checkpoint_every and self.step % tcfg.checkpoint_every == 0
            ) or self.step == stop:
                self.save_checkpoint()
            bar.update(1)
        bar.close()
        return {
            "step": self.step,
            "bytes_seen": self.bytes_seen,
            "wall_seconds": self.wall_seconds,
            "last_train": logs,
            "last_eval": self.last_eval,
        }

    def _describe(self) -> str:
        if self.info.kind == "reference":
            return "reference" if self.teacher is None else "reference (distilling)"
        return "blocks " + ",".join(map(str, self.info.blocks))

    def _postfix(self, logs: dict[str, float]) -> dict[str, str]:
        out = {"loss": f"{logs.get('loss', float('nan')):.3f}"}
        if "bytes_per_s" in logs:
            out["B/s"] = f"{logs['bytes_per_s']:.0f}"
        ev = self.last_eval
        if ev:
            key = "sampler_ce" if "sampler_ce" in ev else "ce" if "ce" in ev else None
            if key:
                out["val_ce"] = f"{ev[key]:.3f}"
        return out
