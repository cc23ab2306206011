"""Generated text, judged (docs/model.md, "Generated text"): every compared model continues the same
fixed prompts and a fixed autoregressive judge, trained apart from them, scores the continuations
(`gen_ce`, `floor_ce` on the real ones, and the byte entropy beside the real text's: a model that
repeats itself can score a low gen_ce, not a real entropy). The per-byte sampler CE of a K > 1
model is a marginal that cannot see whether a span's bytes fit together: this is its quality."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from blocktrain.model import (
    BlockStack,
    Reference,
    Sampling,
    SigmaSchedule,
    generate,
    generate_autoregressive,
    stack_denoiser,
)
from blocktrain.model.sampler import DEFAULT_STEPS_PER_BLOCK, check_sampler, sampler_for
from blocktrain.model.speculative import (
    DEFAULT_VERIFY_DRAWS,
    Drafter,
    SpeculativeLoop,
    check_verify_draws,
    generate_autoregressive_speculative,
    generate_speculative,
)
from blocktrain.training.evaluate import Progress


@dataclass(frozen=True)
class GenSettings:
    """The prompts, the continuations and how they are drawn."""

    prompts: int = 64
    """How many fixed test prompts."""
    prompt_bytes: int = 128
    """Bytes per prompt (a model sees at most its last T - K)."""
    continuation_bytes: int = 128
    """Bytes generated per prompt (and real bytes the floor is measured on)."""
    temperature: float = 1.0
    """Sampling temperature of the compared models (1: their own distribution)."""
    steps_per_block: int = DEFAULT_STEPS_PER_BLOCK
    """Sampler grid points per block (BlockTrain models)."""
    sampler: str | None = None
    """The sampler's step between grid points (BlockTrain models; None: the model's default)."""
    draft_bytes: int = 0
    """Speculative generation (K = 1 BlockTrain models): bytes drafted per verify sweep by the
    drafter passed along; 0: plain sweeps."""
    verify_draws: int = DEFAULT_VERIFY_DRAWS
    """Noise draws per verify sweep of a one-sweep model (model.speculative)."""
    seed: int = 0
    """Seeds the generation."""
    batch_size: int = 64
    """Prompts continued at once."""

    def __post_init__(self) -> None:
        for name in ("prompts", "prompt_bytes", "continuation_bytes", "steps_per_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        if self.draft_bytes < 0:
            raise ValueError(f"draft_bytes = {self.draft_bytes} must be >= 0")
        check_verify_draws(self.verify_draws)
        if self.batch_size <= 0:
            raise ValueError(f"batch_size = {self.batch_size} must be positive")
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature} must be >= 0")
        if self.sampler is not None:
            check_sampler(self.sampler)


def split_prompts(windows: torch.Tensor, prompt_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """windows (P, Lp + Lc) of held-out text -> (prompts (P, Lp), real continuations (P, Lc))."""
    if not 0 < prompt_bytes < windows.shape[1]:
        raise ValueError(f"prompt of {prompt_bytes} bytes in windows of {windows.shape[1]}")
    return windows[:, :prompt_bytes], windows[:, prompt_bytes:]


@torch.no_grad()
def judge_nll(judge: Reference, prompts: torch.Tensor, continuations: torch.Tensor) -> torch.Tensor:
    """The judge's summed NLL (nats) of each continuation given its prompt: prompts (P, Lp),
    continuations (P, Lc) int64 -> (P,) float64. Windows of the judge's T bytes advance by T/2, so
    every scored byte sees between T/2 and T - 1 bytes before it (all of them if Lp + Lc <= T)."""
    device = next(judge.parameters()).device
    full = torch.cat((prompts, continuations), dim=1).to(device)  # (P, L)
    total, first = full.shape[1], prompts.shape[1]
    window = judge.cfg.seq_len
    stride = total - first if total <= window else max(1, window // 2)
    nll = torch.zeros(full.shape[0], dtype=torch.float64, device=device)
    cursor = first  # the next byte to score
    while cursor < total:
        end = min(cursor + stride, total)
        start = max(0, end - window)
        logits = judge(full[:, start:end])  # (P, end - start, 256); position i predicts i + 1
        pred = logits[:, cursor - 1 - start : end - 1 - start].float()
        target = full[:, cursor:end]
        nll += F.cross_entropy(pred.transpose(1, 2), target, reduction="none").sum(1).double()
        cursor = end
    return nll.cpu()


def byte_entropy(data: torch.Tensor) -> float:
    """The unigram entropy (nats) of the byte values in `data`, pooled."""
    counts = torch.bincount(data.flatten().long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


@torch.no_grad()
def continue_prompts(
    model: BlockStack | Reference,
    prompts: torch.Tensor,
    settings: GenSettings,
    drafter: Drafter | None = None,
    progress: Progress | None = None,
) -> tuple[torch.Tensor, int]:
    """Each model's own continuations of prompts (P, Lp): ((P, Lc) int64, the traversals of a
    chain they took: one per span, or per verify sweep), drawn in batches with one generator
    seeded by settings.seed, at settings.temperature (speculatively, one prompt at a time, when
    settings.draft_bytes > 0)."""
    sampling = Sampling(temperature=settings.temperature)
    gen = torch.Generator().manual_seed(settings.seed)
    n = settings.continuation_bytes
    if isinstance(model, Reference):
        device = next(model.parameters()).device
    else:
        device = model.targets.device
    if settings.draft_bytes:
        if drafter is None:
            raise ValueError("speculative continuations need a drafter")
        drafted, traversals = [], 0
        for i in range(prompts.shape[0]):
            one, loop = _speculative(model, prompts[i : i + 1].to(device), settings, drafter, gen)
            drafted.append(one)
            traversals += loop.traversals
            if progress is not None:
                progress(1)
        return torch.cat(drafted), traversals
    out = []
    for start in range(0, prompts.shape[0], settings.batch_size):
        batch = prompts[start : start + settings.batch_size].to(device)
        if isinstance(model, Reference):
            new = generate_autoregressive(
                model, batch, n, seq_len=model.cfg.seq_len, sampling=sampling, generator=gen
            )
        else:
            cfg = model.cfg
            new = generate(
                stack_denoiser(model),
                batch,
                n,
                grid=SigmaSchedule.from_config(cfg).sampler_grid(settings.steps_per_block),
                targets=model.targets,
                span=cfg.span,
                max_context=cfg.seq_len - cfg.span,
                sampling=sampling,
                generator=gen,
                method=sampler_for(settings.sampler),
            )
        out.append(new.cpu())
        if progress is not None:
            progress(batch.shape[0])
    span = 1 if isinstance(model, Reference) else model.cfg.span
    return torch.cat(out), prompts.shape[0] * math.ceil(n / span)


def _speculative(
    model: BlockStack | Reference,
    prompt: torch.Tensor,
    settings: GenSettings,
    drafter: Drafter,
    gen: torch.Generator,
) -> tuple[torch.Tensor, SpeculativeLoop]:
    """One prompt (1, Lp) continued by drafting and verifying: ((1, Lc) on the CPU, the loop
    with its counts)."""
    sampling = Sampling(temperature=settings.temperature)
    n, d, t = settings.continuation_bytes, settings.draft_bytes, model.cfg.seq_len
    if isinstance(model, Reference):
        out, loop = generate_autoregressive_speculative(
            model,
            prompt,
            n,
            drafter=drafter,
            draft_len=d,
            seq_len=t,
            sampling=sampling,
            generator=gen,
        )
        return out.cpu(), loop
    if model.cfg.span != 1:
        raise ValueError("speculative continuations verify with a K = 1 model")
    out, loop = generate_speculative(
        stack_denoiser(model),
        prompt,
        n,
        drafter=drafter,
        draft_len=d,
        grid=SigmaSchedule.from_config(model.cfg).sampler_grid(settings.steps_per_block),
        targets=model.targets,
        seq_len=t,
        sampling=sampling,
        generator=gen,
        method=sampler_for(settings.sampler),
        draws=settings.verify_draws,
    )
    return out.cpu(), loop


def judge_continuations(
    judge: Reference, prompts: torch.Tensor, generated: torch.Tensor, real: torch.Tensor
) -> dict[str, Any]:
    """gen_ce, floor_ce (nats/byte) and the entropies of generated (P, Lc) and real (P, Lc)
    continuations of prompts (P, Lp)."""
    gen_nll = judge_nll(judge, prompts, generated)
    real_nll = judge_nll(judge, prompts, real)
    per_prompt = gen_nll / generated.shape[1]
    return {
        "gen_ce": float(gen_nll.sum()) / generated.numel(),
        # The spread of gen_ce over prompts, for error bars: the standard error of the mean.
        "gen_ce_sem": float(per_prompt.std() / math.sqrt(len(per_prompt)))
        if len(per_prompt) > 1
        else float("nan"),
        "floor_ce": float(real_nll.sum()) / real.numel(),
        "entropy": byte_entropy(generated),
        "real_entropy": byte_entropy(real),
        "prompts": prompts.shape[0],
        "prompt_bytes": prompts.shape[1],
        "continuation_bytes": generated.shape[1],
    }


def evaluate_generation(
    model: BlockStack | Reference,
    judge: Reference,
    windows: torch.Tensor,
    settings: GenSettings,
    drafter: Drafter | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """windows (P, Lp + Lc) held-out text -> the model's continuations judged (see above), with
    a few of them as text for a reader."""
    prompts, real = split_prompts(windows, settings.prompt_bytes)
    generated, traversals = continue_prompts(model, prompts, settings, drafter, progress)
    result = judge_continuations(judge, prompts, generated, real)
    result["bytes_per_traversal"] = generated.numel() / traversals
    result["samples"] = [
        {
            "prompt": bytes(prompts[i].tolist()).decode("utf-8", "replace"),
            "generated": bytes(generated[i].tolist()).decode("utf-8", "replace"),
            "real": bytes(real[i].tolist()).decode("utf-8", "replace"),
        }
        for i in range(min(3, prompts.shape[0]))
    ]
    result.update(
        temperature=settings.temperature,
        steps_per_block=settings.steps_per_block,
        sampler=None if isinstance(model, Reference) else sampler_for(settings.sampler),
        draft_bytes=settings.draft_bytes,
        verify_draws=settings.verify_draws,
        seed=settings.seed,
    )
    return result
