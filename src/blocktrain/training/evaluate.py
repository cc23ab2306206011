"""Quality on held-out text in nats per byte: every figure, its windows and what it scores are in
docs/model.md, Evaluation. For K > 1 `sampler_ce` is a per-byte marginal, only a diagnostic;
`joint_ce` and the judged text (training/generated.py) are the quality, never the marginal."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from blocktrain.model import BlockStack, Reference, SigmaSchedule, ZLayout, head_logits, one_sweep
from blocktrain.model.sampler import DEFAULT_STEPS_PER_BLOCK, sampler_for, stack_denoiser

Progress = Callable[[int], None]
"""Told how many more windows (or prompts) are done, after each batch (a progress bar)."""


@dataclass(frozen=True)
class EvalSettings:
    sweeps: int = 16
    """M, the number of independent sweeps for the sampler CE."""
    steps_per_block: int = DEFAULT_STEPS_PER_BLOCK
    """Sampler grid points per block."""
    seed: int = 0
    """Seeds the initial noise and the oracle's sigmas."""
    batch_size: int = 16
    """Windows per forward pass."""
    sampler: str | None = None
    """The sampler's step: "euler" (the design, section 2.6) or "ancestral" (re-noise from a
    sample); None: the default."""
    oracle: bool = True
    """Also measure each block's oracle CE (one more forward per block; per-round curves that
    only need the from-noise CE turn it off)."""


def _scored(t: int) -> slice:
    return slice(1, t)


@torch.no_grad()
def head_nll(stack: BlockStack, block: int, x: torch.Tensor) -> float:
    """Summed CE of block `block`'s next-byte head (`head_logits`) on bytes 1..T-1 of x (N, T);
    NaN for a block without the head."""
    if stack.block(block).aux_head is None:
        return math.nan
    logits = head_logits(stack, x, block)[:, :-1].float()
    return float(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))


def _oracle_nll(
    stack: BlockStack, block: int, x: torch.Tensor, layout: ZLayout, generator: torch.Generator
) -> float:
    """Summed CE of `block` on the scored bytes of x, with z = E[y] + sigma * eps and sigma
    drawn from the block's own interval (no overlap)."""
    cfg = stack.cfg
    schedule = SigmaSchedule.from_config(cfg)
    n, t = x.shape
    sigma = schedule.sample_sigma(*schedule.interval(block), n, generator)
    eps = torch.randn(n, t, cfg.d_model, generator=generator, device=x.device)
    z = stack.targets[x] + sigma[:, None, None] * eps
    logits = stack.denoise(block, x, z, sigma, layout)[0]
    keep = _scored(t)
    return float(
        F.cross_entropy(
            logits[:, keep].float().flatten(0, 1), x[:, keep].flatten(), reduction="sum"
        )
    )


def ce_summary(ce: float) -> dict[str, float]:
    """Bits per byte and perplexity; a wrecked model's CE past ~709 nats (bench/adversarial.py,
    ascend undefended) has an infinite perplexity rather than an OverflowError."""
    perplexity = math.exp(ce) if ce < math.log(sys.float_info.max) else math.inf
    return {"bits_per_byte": ce / math.log(2), "perplexity": perplexity}


@torch.no_grad()
def evaluate_blocktrain(
    stack: BlockStack,
    windows: torch.Tensor,
    settings: EvalSettings,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """windows (W, T) int64 held-out bytes -> the metrics of docs/model.md, Evaluation (all blocks
    present)."""
    cfg = stack.cfg
    method = sampler_for(settings.sampler)
    device = stack.targets.device
    schedule = SigmaSchedule.from_config(cfg)
    grid = schedule.sampler_grid(settings.steps_per_block)
    denoise = stack_denoiser(stack)
    layout = ZLayout.training(cfg.seq_len, cfg.span, device)
    gen = torch.Generator(device).manual_seed(settings.seed)
    m = settings.sweeps
    keep = _scored(cfg.seq_len)

    n_scored = 0
    sampler_nll = 0.0
    joint_nll = 0.0
    from_noise_nll = 0.0
    step_nll = [0.0] * len(grid)
    step_mix_nll = [0.0] * len(grid)
    sub_ms = [2**i for i in range(settings.sweeps.bit_length()) if 2**i < settings.sweeps]
    sub_nll = dict.fromkeys(sub_ms, 0.0)
    oracle_nll = [0.0] * cfg.blocks
    head = [0.0] * cfg.blocks
    for start in range(0, windows.shape[0], settings.batch_size):
        x = windows[start : start + settings.batch_size].to(device)  # (N, T)
        n, t = x.shape
        target = x[:, keep]
        logp_true = torch.empty(m, n, t - 1, device=device)  # log p_m(true byte)
        logp_steps = torch.empty(len(grid), m, n, t - 1, device=device)  # the same, every step
        this_sweep: list[torch.Tensor] = []  # log p(true byte) at each step of the current sweep

        def record(
            step: int,
            _block: int,
            _sigma: float,
            logits: torch.Tensor,
            target: torch.Tensor = target,
            this_sweep: list[torch.Tensor] = this_sweep,
        ) -> None:
            logp = logits[:, keep].float().log_softmax(dim=-1).gather(-1, target[..., None])[..., 0]
            this_sweep.append(logp)
            step_nll[step] -= float(logp.sum())

        for sweep in range(m):
            z = cfg.sigma_max * torch.randn(n, t, cfg.d_model, generator=gen, device=device)
            logits = one_sweep(
                denoise,
                x,
                z,
                grid,
                stack.targets,
                layout,
                on_step=record,
                method=method,
                generator=gen,
            )
            logp = logits[:, keep].float().log_softmax(dim=-1)
            logp_true[sweep] = logp.gather(-1, target[..., None])[..., 0]
            logp_steps[:, sweep] = torch.stack(this_sweep)
            this_sweep.clear()
        from_noise_nll -= float(logp_true.sum()) / m
        for step in range(len(grid)):
            step_mix_nll[step] -= float((logp_steps[step].logsumexp(dim=0) - math.log(m)).sum())
        sampler_nll -= float((logp_true.logsumexp(dim=0) - math.log(m)).sum())
        # Whole spans: the product of a sweep's probabilities over the K bytes of each span.
        spans = F.pad(logp_true, (1, 0)).view(m, n, t // cfg.span, cfg.span).sum(-1)
        joint_nll -= float((spans.logsumexp(dim=0) - math.log(m)).sum())
        for k in sub_ms:
            sub_nll[k] -= float((logp_true[:k].logsumexp(dim=0) - math.log(k)).sum())
        if settings.oracle:
            for b in range(cfg.blocks):
                oracle_nll[b] += _oracle_nll(stack, b, x, layout, gen)
        for b in range(cfg.blocks):
            head[b] += head_nll(stack, b, x)
        n_scored += target.numel()
        if progress is not None:
            progress(n)

    sampler_ce = sampler_nll / n_scored
    return {
        "sampler_ce": sampler_ce,
        "joint_ce": joint_nll / n_scored,
        "span": cfg.span,
        "from_noise_ce": from_noise_nll / n_scored,
        "ce_per_step": [v / (n_scored * m) for v in step_nll],
        "sampler_ce_per_step": [v / n_scored for v in step_mix_nll],
        "sampler_ce_by_sweeps": {str(k): v / n_scored for k, v in sub_nll.items()},
        "oracle_ce": sum(oracle_nll) / (n_scored * cfg.blocks) if settings.oracle else None,
        "oracle_ce_per_block": [v / n_scored for v in oracle_nll] if settings.oracle else None,
        "head_ce_per_block": [v / n_scored for v in head],
        **ce_summary(sampler_ce),
        "sweeps": m,
        "steps_per_block": settings.steps_per_block,
        "sampler": method,
        "bytes": n_scored,
    }


@torch.no_grad()
def evaluate_reference(
    model: Reference,
    windows: torch.Tensor,
    settings: EvalSettings,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The reference's plain next-byte CE on the same scored bytes."""
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for start in range(0, windows.shape[0], settings.batch_size):
        x = windows[start : start + settings.batch_size].to(device)
        logits = model(x)[:, :-1]  # position i predicts byte i + 1: bytes 1..T-1
        nll += float(
            F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        )
        count += x[:, 1:].numel()
        if progress is not None:
            progress(x.shape[0])
    ce = nll / count
    return {"ce": ce, **ce_summary(ce), "bytes": count}


@torch.no_grad()
def evaluate_oracle_block(
    stack: BlockStack, block: int, windows: torch.Tensor, settings: EvalSettings
) -> dict[str, Any]:
    """For a process that holds a single block: its CE on truly noised targets, the only
    quality figure a worker can compute alone."""
    cfg = stack.cfg
    device = stack.targets.device
    layout = ZLayout.training(cfg.seq_len, cfg.span, device)
    gen = torch.Generator(device).manual_seed(settings.seed)
    nll = 0.0
    for start in range(0, windows.shape[0], settings.batch_size):
        nll += _oracle_nll(
            stack, block, windows[start : start + settings.batch_size].to(device), layout, gen
        )
    count = windows.shape[0] * (cfg.seq_len - 1)
    return {"oracle_ce": nll / count, "block": block, "bytes": count}
