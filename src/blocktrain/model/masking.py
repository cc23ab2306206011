"""Block-local masked span diffusion (`process = masked`, docs/model.md, "Masked span diffusion";
DiffusionBlocks' appendix D, made block-local).

A span's state is z_i = E[y_i] for a revealed byte and 0 for a masked one: it determines the
revealed bytes exactly, so the state passed between block hosts keeps the Gaussian models' shape
and wire format. The mask rate t (the share of a span still masked) plays the part of sigma:

- training: block b owns t in [(B-1-b)/B, (B-b)/B] (block 0 the most masked), widened by the
  overlap; a sequence draws t, and each span byte is masked with probability t, or (for a share of
  the sequences, `mask_suffix_share`) the last round(t K) bytes of every span are, the states
  the sampler visits;
- sampling: all masked; block b takes each span from the top of its interval to the bottom, in up
  to S rounds, each revealing the leftmost masked bytes drawn from that round's logits. With B S
  >= K every round reveals one byte: a left-to-right factorisation with an exact likelihood.

The block sees t through its noise embedding as sigma = 10^t (`mask_code`): it only needs a
monotone code of t, and this one keeps c_noise in the range the Gaussian blocks' embedding sees.
"""

from __future__ import annotations

import math

import torch

PIN_LOGIT = -1.0e4
"""The logit of every byte but the revealed one in a revealed position's final logits: finite
(it travels on the wire), and a point mass after any temperature, top-k or top-p."""


def mask_code(masked: int, span: int) -> float:
    """The noise level a block sees for `masked` of `span` bytes still masked: 10^(masked/K)."""
    return 10.0 ** (masked / span)


def masked_count(code: float, span: int) -> int:
    """The inverse of `mask_code`: how many bytes of a span are masked at this grid point."""
    return round(span * math.log10(code))


def mask_interval(block: int, blocks: int, overlap: float) -> tuple[float, float]:
    """The mask rates block `block` trains on: its share of [0, 1] widened by `overlap` of its
    width on each side, clamped."""
    if not 0 <= block < blocks:
        raise ValueError(f"block {block} outside 0..{blocks - 1}")
    lo, hi = (blocks - 1 - block) / blocks, (blocks - block) / blocks
    width = hi - lo
    return max(0.0, lo - overlap * width), min(1.0, hi + overlap * width)


def masked_grid(span: int, blocks: int, steps_per_block: int) -> list[tuple[int, float]]:
    """The sampler's points (block, mask_code): block b reveals the bytes from round(K (B-b)/B)
    masked down to round(K (B-1-b)/B), in min(S, its bytes) rounds of as equal a size as may be
    (the earlier rounds take the larger share). A point's reveals are the difference between
    its masked count and the next point's (0 after the last)."""
    if steps_per_block < 1:
        raise ValueError("steps_per_block must be >= 1")
    grid = []
    left = span
    for b in range(blocks):
        target = round(span * (blocks - 1 - b) / blocks)
        rounds = min(steps_per_block, left - target)
        for s in range(rounds):
            grid.append((b, mask_code(left, span)))
            left -= math.ceil((left - target) / (rounds - s))
    return grid


def masked_state(targets: torch.Tensor, y: torch.Tensor, revealed: torch.Tensor) -> torch.Tensor:
    """z (..., d): E[y] where revealed, 0 where masked."""
    return targets[y] * revealed[..., None].to(targets.dtype)


def read_state(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z (..., d) -> (revealed (...) bool, y (...) int64, exact where revealed): E's rows have
    unit norm and E[y] is nearer E[y] than any other row, whatever the wire dtype."""
    revealed = z.norm(dim=-1) > 0.5
    y = (z.to(targets.dtype) @ targets.T).argmax(dim=-1)
    return revealed, y


def to_reveal(revealed: torch.Tensor, still_masked: int) -> torch.Tensor:
    """revealed (..., K) -> the masked positions (..., K) to reveal now so that `still_masked`
    stay masked: the leftmost ones (left to right)."""
    masked = ~revealed
    take = masked.sum(dim=-1, keepdim=True) - still_masked
    return masked & (masked.long().cumsum(dim=-1) <= take)


def draw_masks(
    x: torch.Tensor, t: torch.Tensor, span: int, generator: torch.Generator, suffix_share: float
) -> torch.Tensor:
    """The training masks (N, T) bool for bytes x (N, T) at mask rates t (N,): each byte masked
    with probability t, or, for `suffix_share` of the rows (`mask_suffix_share`), the last
    round(t K) bytes of every span."""
    n, seq = x.shape
    dev = generator.device
    random = torch.rand(n, seq, generator=generator, device=dev) < t[:, None]
    in_span = (torch.arange(seq, device=dev) % span)[None, :]
    suffix = in_span >= torch.round((1 - t) * span)[:, None]
    rows = torch.rand(n, generator=generator, device=dev) < suffix_share
    return torch.where(rows[:, None], suffix, random).to(x.device)


def pin_revealed(logits: torch.Tensor, z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (..., 256) with every revealed position of z (..., d) made a point mass on its
    byte, so that drawing bytes from them keeps the revealed ones and draws the rest."""
    revealed, y = read_state(z, targets)
    pinned = torch.full_like(logits, PIN_LOGIT).scatter(-1, y[..., None], 0.0)
    return torch.where(revealed[..., None], pinned, logits)
