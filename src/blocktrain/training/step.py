"""One update of one trainable unit: the step that `Trainer` runs for each of its blocks (or the
reference) and that a worker's `LocalBlockTrainer` runs for its block. Written once so that the
two cannot drift apart (they once did: workers ignored `precision=bf16`).

Reproducibility by construction: the batch and the noise of update `step` of unit `u` are drawn
from generators seeded by (seed, u, step) alone, so a resumed run sees the same batches as an
uninterrupted one, and a worker whose data seed is the run seed takes the trainer's step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blocktrain.config import RunConfig
from blocktrain.data import ByteSource
from blocktrain.training.loss import LossParts
from blocktrain.training.optim import learning_rate, set_learning_rate

# The loss of one unit on a batch of bytes (N, T), drawing its noise from the generator.
Objective = Callable[[torch.Tensor, torch.Generator], LossParts]

_BATCH_SALT, _NOISE_SALT = 1, 2


def stream_seed(seed: int, unit: int, step: int, salt: int) -> int:
    """A 63-bit seed for one (run seed, unit, step, purpose); cheap and collision-averse."""
    h = (
        seed * 0x9E3779B97F4A7C15
        + unit * 0xC2B2AE3D27D4EB4F
        + step * 0x165667B19E3779F9
        + salt * 0x27D4EB2F165667C5
    ) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def precision_context(
    precision: str, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    """The context a forward pass of `TrainConfig.precision` runs in: bf16 autocast on the
    device's type, or nothing for fp32. Whatever measures what training runs (FLOP counts, the
    benchmarks' evaluations) enters the same context."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class StepResult:
    logs: dict[str, float]  # the loss's logs, and grad_norm when gradients are clipped
    tokens: int  # target bytes in the batch
    batch: torch.Tensor  # the bytes (N, T) it trained on
    clean: torch.Tensor | None = None  # its relayed clean output (`LossParts.clean`)


def train_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    objective: Objective,
    data: ByteSource,
    cfg: RunConfig,
    *,
    seed: int,
    unit: int,
    step: int,
    device: torch.device,
    batch: torch.Tensor | None = None,
) -> StepResult:
    """One AdamW update of `module` at run step `step` (which sets the learning rate), on the
    batch and noise seeded by (seed, unit, step); `batch` (N, T): train on these bytes instead
    (`route = relay`: those the block before computed the relayed features on)."""
    tcfg = cfg.train
    if batch is None:
        batch_gen = torch.Generator().manual_seed(stream_seed(seed, unit, step, _BATCH_SALT))
        batch = data.sample(tcfg.batch_size, cfg.model.seq_len, batch_gen)  # (N, T)
    x = batch.to(device, non_blocking=True)
    noise_gen = torch.Generator(device).manual_seed(stream_seed(seed, unit, step, _NOISE_SALT))
    with precision_context(tcfg.precision, device):
        parts = objective(x, noise_gen)
    optimizer.zero_grad(set_to_none=True)
    parts.total.backward()
    logs = dict(parts.logs)
    if tcfg.grad_clip > 0:
        logs["grad_norm"] = float(
            torch.nn.utils.clip_grad_norm_(module.parameters(), tcfg.grad_clip)
        )
    set_learning_rate(optimizer, learning_rate(step, tcfg))
    optimizer.step()
    return StepResult(logs, x.numel(), x, parts.clean)
