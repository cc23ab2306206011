"""Noise levels: the equal-mass partition, EDM scalings (Karras et al. 2022, arXiv 2206.00364),
training draws and the sampler grid (docs/model.md, "Noise levels").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from blocktrain.config import ModelConfig

_STD_NORMAL = NormalDist()


@dataclass(frozen=True)
class SigmaSchedule:
    """The log-normal noise distribution truncated to [sigma_min, sigma_max], split into
    `blocks` intervals of equal probability mass."""

    sigma_min: float
    sigma_max: float
    p_mean: float
    p_std: float
    blocks: int
    overlap: float
    reversed: bool = False
    """`intervals = reversed`: the last block owns the highest interval, block 0 the lowest."""

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> SigmaSchedule:
        return cls(
            cfg.sigma_min,
            cfg.sigma_max,
            cfg.p_mean,
            cfg.p_std,
            cfg.blocks,
            cfg.overlap,
            cfg.intervals == "reversed",
        )

    def cdf(self, sigma: float) -> float:
        """q(s) = Phi((ln s - P_mean) / P_std)."""
        return _STD_NORMAL.cdf((math.log(sigma) - self.p_mean) / self.p_std)

    def inverse_cdf(self, q: float) -> float:
        """sigma = exp(P_mean + P_std * Phi^-1(q)), clamped to the range against rounding."""
        q = min(max(q, 1e-12), 1 - 1e-12)
        sigma = math.exp(self.p_mean + self.p_std * _STD_NORMAL.inv_cdf(q))
        return min(max(sigma, self.sigma_min), self.sigma_max)

    def boundaries(self) -> list[float]:
        """The B + 1 interval ends in increasing sigma: `sigma_b` for q_b = q(min) + b/B * mass."""
        q_lo, q_hi = self.cdf(self.sigma_min), self.cdf(self.sigma_max)
        inner = [
            self.inverse_cdf(q_lo + b / self.blocks * (q_hi - q_lo)) for b in range(1, self.blocks)
        ]
        return [self.sigma_min, *inner, self.sigma_max]

    def rank(self, block: int) -> int:
        """The block's place in the sweep: 0 for the highest interval, B - 1 for the lowest."""
        return self.blocks - 1 - block if self.reversed else block

    def interval(self, block: int) -> tuple[float, float]:
        """(lower, upper) sigma owned by `block`; block 0 owns the highest interval (the last
        block under `reversed`)."""
        if not 0 <= block < self.blocks:
            raise ValueError(f"block {block} outside 0..{self.blocks - 1}")
        bounds = self.boundaries()
        i = self.blocks - 1 - self.rank(block)
        return bounds[i], bounds[i + 1]

    def training_interval(self, block: int) -> tuple[float, float]:
        """The block's interval widened by `overlap` of its log-width on each side, clamped."""
        lo, hi = self.interval(block)
        r = math.log(hi) - math.log(lo)
        return (
            max(self.sigma_min, lo * math.exp(-self.overlap * r)),
            min(self.sigma_max, hi * math.exp(self.overlap * r)),
        )

    def sample_sigma(
        self, lo: float, hi: float, n: int, generator: torch.Generator
    ) -> torch.Tensor:
        """n sigmas in [lo, hi] by inverse CDF: u ~ U(q(lo), q(hi)), sigma = q^-1(u).
        -> (n,) float32 on the generator's device."""
        q_lo, q_hi = self.cdf(lo), self.cdf(hi)
        u = q_lo + (q_hi - q_lo) * torch.rand(
            n, generator=generator, dtype=torch.float64, device=generator.device
        )
        sigma = torch.exp(self.p_mean + self.p_std * torch.special.ndtri(u))
        return sigma.clamp(lo, hi).to(torch.float32)

    def sample_training_sigma(self, block: int, n: int, generator: torch.Generator) -> torch.Tensor:
        """n training sigmas for `block`, from its interval widened by the overlap."""
        return self.sample_sigma(*self.training_interval(block), n, generator)

    def sampler_grid(self, steps_per_block: int) -> list[tuple[int, float]]:
        """The one-sweep grid: B * steps_per_block sigmas evenly spaced in q from sigma_max down
        to sigma_min (the DiffusionBlocks schedule), each with the block that owns it (point n:
        rank n // steps_per_block, always inside that block's interval)."""
        if steps_per_block < 1:
            raise ValueError("steps_per_block must be >= 1")
        n_points = self.blocks * steps_per_block
        q_lo, q_hi = self.cdf(self.sigma_min), self.cdf(self.sigma_max)
        grid = []
        for n in range(n_points):
            frac = 1.0 - n / (n_points - 1) if n_points > 1 else 0.0
            sigma = (
                self.sigma_max
                if n == 0
                else self.sigma_min
                if n == n_points - 1
                else self.inverse_cdf(q_lo + frac * (q_hi - q_lo))
            )
            grid.append((self.rank(n // steps_per_block), sigma))
        return grid


@dataclass(frozen=True)
class EDMScalings:
    """The preconditioning coefficients for one or more sigmas (tensors of sigma's shape)."""

    c_skip: torch.Tensor
    c_out: torch.Tensor
    c_in: torch.Tensor
    c_noise: torch.Tensor


def edm_scalings(sigma: torch.Tensor, sigma_data: float) -> EDMScalings:
    """EDM preconditioning (Karras et al. 2022, Table 1):
    c_skip = sd^2 / (s^2 + sd^2), c_out = s * sd / sqrt(s^2 + sd^2), c_in = 1 / sqrt(s^2 + sd^2),
    c_noise = ln(s) / 4. Every caller (block, loss, tests) goes through this one function."""
    sd2 = sigma_data**2
    total = sigma**2 + sd2
    return EDMScalings(
        c_skip=sd2 / total,
        c_out=sigma * sigma_data / total.sqrt(),
        c_in=total.rsqrt(),
        c_noise=sigma.log() / 4,
    )


def loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """EDM loss weight w(s) = (s^2 + sd^2) / (s * sd)^2, normalised by sd^2 so that it tends to 1
    at high noise: w(s) * sd^2 = 1 + sd^2 / s^2. The normalisation is a constant factor."""
    return 1.0 + sigma_data**2 / sigma**2
