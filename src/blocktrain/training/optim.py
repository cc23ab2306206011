"""AdamW with warmup and cosine decay, and its state as flat tensors (for safetensors)."""

from __future__ import annotations

import math

import torch
from torch import nn

from blocktrain.config import TrainConfig
from blocktrain.errors import CheckpointError

ADAM_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
ADAMW_BYTES_PER_PARAM = 8  # two fp32 moments per parameter


def make_optimizer(module: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (not on embeddings, norms, biases)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        is_matrix = param.dim() >= 2 and "embed" not in name
        (decay if is_matrix else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel updates all parameters in one pass per tensor (CPU and CUDA).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at
    cfg.steps. `step` counts updates already done (0 for the first update)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, module: nn.Module, prefix: str
) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state keyed by parameter name: `{prefix}{name}.exp_avg` etc."""
    names = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        for key in ADAM_STATE_KEYS:
            if key in state:
                value = state[key]
                out[f"{prefix}{names[id(param)]}.{key}"] = (
                    value if torch.is_tensor(value) else torch.tensor(float(value))
                )
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    prefix: str,
    tensors: dict[str, torch.Tensor],
) -> None:
    """Restore what `optimizer_tensors` saved, exactly, into a fresh optimizer over `module`.
    The step count lives where torch keeps it: on the parameter's device for a fused (or
    capturable) AdamW, which `make_optimizer` builds, else on the CPU."""
    on_device = {
        id(p)
        for group in optimizer.param_groups
        if group.get("fused") or group.get("capturable")
        for p in group["params"]
    }
    for name, param in module.named_parameters():
        keys = [f"{prefix}{name}.{k}" for k in ADAM_STATE_KEYS]
        present = [k in tensors for k in keys]
        if not any(present):
            continue
        if not all(present):
            raise CheckpointError(f"optimizer state for {prefix}{name} is incomplete")
        step, avg, avg_sq = (tensors[k] for k in keys)
        if avg.shape != param.shape or avg_sq.shape != param.shape:
            raise CheckpointError(f"optimizer state for {prefix}{name} has the wrong shape")
        optimizer.state[param] = {
            "step": (
                step.to(param.device, torch.float32) if id(param) in on_device else step
            ).clone(),
            "exp_avg": avg.to(param.device).clone(),
            "exp_avg_sq": avg_sq.to(param.device).clone(),
        }
