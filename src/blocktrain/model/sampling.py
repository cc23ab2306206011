"""How bytes are drawn from logits (``Sampling``: greedy, temperature, top-k, top-p, UTF-8 only),
written once for every generator: the one-sweep sampler, the reference, speculative decoding and
the hosts, so that equal settings and seeds draw equal bytes everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blocktrain.model import utf8


@dataclass(frozen=True)
class Sampling:
    """How bytes are drawn from the final logits."""

    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely bytes (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of bytes whose probability reaches p (1: all)."""
    utf8: bool = False
    """Keep the text valid UTF-8 (model/utf8.py): draw each byte from the bytes that may follow
    those before it, position by position, before temperature, top-k and top-p."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature} must be >= 0")
        if not 0 <= self.top_k <= 256:
            raise ValueError(f"top_k = {self.top_k} must lie in 0..256")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must lie in (0, 1]")


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits (..., 256) -> the distribution (..., 256) fp32 that `sample_bytes` draws from:
    temperature, then top-k, then top-p; greedy (temperature 0) is a point mass on the argmax."""
    logits = logits.float()
    if sampling.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum - sorted_logits.softmax(dim=-1) >= sampling.top_p  # keep the first past p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample_bytes(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (..., 256) -> bytes (...) int64. With `sampling.utf8`, logits are (N, 256) or
    (N, K, 256), the K positions drawn one after another, each valid after `prefix` (N, L), the
    bytes before them (None: the start of a text; its last 3 bytes are enough)."""
    if sampling.utf8:
        return utf8.draw_valid(logits, prefix, lambda lg: _draw(lg, sampling, generator)).to(
            logits.device
        )
    return _draw(logits, sampling, generator)


def _draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """sample_bytes without the UTF-8 constraint."""
    if sampling.temperature == 0:
        return logits.float().argmax(dim=-1)
    probs = sampling_probs(logits, sampling)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
