"""The one-sweep sampler: a pure loop over a sigma grid that only calls a denoiser
`denoise(block_index, x_bytes, z, sigma, layout) -> logits (N, Lz, 256)`, so a local BlockStack,
one worker's block or a chain of remote hosts all plug in. docs/model.md, "The sampler".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blocktrain.model.block import ZLayout
from blocktrain.model.sampling import Sampling, sample_bytes
from blocktrain.model.span_loop import SpanLoop
from blocktrain.model.stack import BlockStack

Denoiser = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, ZLayout], torch.Tensor]
StepHook = Callable[[int, int, float, torch.Tensor], None]
RowGenerators = list[tuple[int, torch.Generator]]
"""A batch of several requests (a block host's batched sweep): (rows, generator) per request, in
row order, so that each request's noise comes from its own generator, drawn as if it ran alone."""


def stack_denoiser(stack: BlockStack) -> Denoiser:
    """The denoiser of the blocks held in this process."""

    def denoise(
        b: int, x: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor, layout: ZLayout
    ) -> torch.Tensor:
        return stack.denoise(b, x, z, sigma, layout)[0]

    return denoise


def euler_step(
    z: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, sigma: float, sigma_next: float
) -> torch.Tensor:
    """One Euler step of the probability-flow ODE towards the expected target embedding:
    D_hat = softmax(logits) @ E,  z <- z + (sigma_next - sigma) * (z - D_hat) / sigma."""
    d_hat = torch.softmax(logits.float(), dim=-1) @ targets  # (N, Lz, d)
    return z + (sigma_next - sigma) * (z - d_hat) / sigma


def ancestral_step(
    logits: torch.Tensor, targets: torch.Tensor, sigma_next: float, generator: torch.Generator
) -> torch.Tensor:
    """Re-noise from a sampled prediction: y_hat ~ softmax(logits), z <- E[y_hat] + sigma_next *
    eps, exactly the form the next block was trained on."""
    gdev = generator.device  # draw on the generator's device, use on the logits' device
    probs = torch.softmax(logits.float(), dim=-1).to(gdev)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    y_hat = flat.reshape(probs.shape[:-1]).to(logits.device)  # (N, Lz)
    eps = torch.randn(*y_hat.shape, targets.shape[1], generator=generator, device=gdev)
    return targets[y_hat] + sigma_next * eps.to(logits.device)


def antithetic_normal(
    copies: int, shape: tuple[int, ...], generator: torch.Generator
) -> torch.Tensor:
    """`copies` standard normal draws of `shape` (copies, *shape), in antithetic pairs (the
    first ceil(M / 2) drawn, the rest minus those). Each copy alone is a standard normal draw,
    so a mean over them keeps its expectation; near odd functions cancel much of their variance."""
    drawn = torch.randn((copies + 1) // 2, *shape, generator=generator, device=generator.device)
    return torch.cat((drawn, -drawn[: copies // 2]))


def fork_step(
    logits: torch.Tensor,
    targets: torch.Tensor,
    sigma_next: float,
    draws: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """The ancestral step into a fork point (Fork): logits (N, L, 256) -> the states of `draws`
    copies of the L tokens (N, draws * L, d), each E[y_hat] + sigma_next * eps.

    The bytes are drawn stratified (copy m inverts the CDF at (u + m) / M for one uniform u) and
    the noises in antithetic pairs. Copy m alone is not distributed as one draw, but a copy
    picked at random is, so the mean of the copies' laws keeps the expectation a verify sweep's
    rule needs, with fewer rejections (BENCHMARKS.md, "Speculative K = 1: bytes per verify
    traversal")."""
    n, length, vocab = logits.shape
    gdev = generator.device
    probs = torch.softmax(logits.float(), dim=-1).to(gdev).reshape(-1, vocab).double()
    cdf = probs.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    u = torch.rand(n * length, 1, generator=generator, dtype=torch.float64, device=gdev)
    strata = (u + torch.arange(draws, dtype=torch.float64, device=gdev)) / draws
    y_hat = torch.searchsorted(cdf, strata, right=True).clamp(max=vocab - 1)  # (N L, M)
    y_hat = y_hat.reshape(n, length, draws).transpose(1, 2).reshape(n, draws * length)
    eps = antithetic_normal(draws, (n, length, targets.shape[1]), generator)
    eps = eps.transpose(0, 1).reshape(n, draws * length, -1)
    return targets[y_hat.to(logits.device)] + sigma_next * eps.to(logits.device)


def _per_rows(
    step: Callable[..., torch.Tensor],
    logits: torch.Tensor,
    generator: torch.Generator | RowGenerators,
) -> torch.Tensor:
    """step(logits, generator=...), a step that draws, run on each request's rows with its own
    generator."""
    if isinstance(generator, torch.Generator):
        return step(logits, generator=generator)
    parts = logits.split([rows for rows, _ in generator])
    return torch.cat([step(p, generator=g) for p, (_, g) in zip(parts, generator, strict=True)])


SAMPLERS = ("euler", "ancestral")
"""The sampler steps between grid points: "euler" (deterministic: Euler on the probability-flow
ODE, the default) or "ancestral" (re-noise from a sampled byte; draws from the generator)."""

DEFAULT_SAMPLER = "euler"
DEFAULT_STEPS_PER_BLOCK = 1
# The recipe that generation (`blocktrain generate`, the router) and evaluation use when none is
# named: the best measured one (docs/research/spans.md, "Span generation: speed and quality").


def check_sampler(method: str) -> str:
    if method not in SAMPLERS:
        raise ValueError(f"unknown sampler {method!r}; choose one of {', '.join(SAMPLERS)}")
    return method


def sampler_for(method: str | None) -> str:
    """The sampler a request of `method` runs (None: the default), or a ValueError."""
    return DEFAULT_SAMPLER if method is None else check_sampler(method)


def needs_generator(method: str) -> bool:
    """Whether the steps of `method` draw random numbers (then they need the generator)."""
    return check_sampler(method) == "ancestral"


@dataclass(frozen=True)
class Fork:
    """Noise draws that share a sweep up to grid point `point` (model.speculative's verify
    draws): the ancestral step into `point` makes `draws` copies of the state's tokens
    (fork_step), which run under `layout` from `point` on. Only the ancestral sampler draws at a
    step (an Euler step would copy one state `draws` times)."""

    point: int
    draws: int
    layout: ZLayout
    """The layout of the copies: the state's tokens `draws` times over, draw after draw."""


def run_points(
    denoise: Denoiser,
    x_bytes: torch.Tensor,
    z: torch.Tensor,
    grid: list[tuple[int, float]],
    targets: torch.Tensor,
    layout: ZLayout,
    *,
    start: int = 0,
    stop: int | None = None,
    method: str = "euler",
    generator: torch.Generator | RowGenerators | None = None,
    on_step: StepHook | None = None,
    fork: Fork | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sweep itself, written once: grid points start..stop-1 on z (N, Lz, d), which lies at
    grid[start]'s sigma -> (z at grid[stop] (as it was, at the grid's last point), the logits
    (N, Lz, 256) of point stop - 1). `on_step(n, block, sigma, logits)` sees every point's
    logits. `fork` (ancestral only): from fork.point on, z holds fork.draws copies under
    fork.layout; a run that starts at or past the point is given the copies already."""
    check_sampler(method)
    stop = len(grid) if stop is None else stop
    if not 0 <= start < stop <= len(grid):
        raise ValueError(f"grid points {start}..{stop - 1} do not lie in 0..{len(grid) - 1}")
    if needs_generator(method) and generator is None:
        raise ValueError(f"the {method} sampler needs a generator")
    if fork is not None:
        if method != "ancestral" or not 0 < fork.point < len(grid):
            raise ValueError(
                f"draws fork at a grid point 1..{len(grid) - 1} of the ancestral sampler, "
                f"not at {fork.point} of {method}"
            )
        if start >= fork.point:
            layout = fork.layout
    n_seq = x_bytes.shape[0]
    logits = z.new_empty(0)
    for n in range(start, stop):
        block, sigma = grid[n]
        sigma_t = torch.full((n_seq,), sigma, dtype=torch.float32, device=z.device)
        logits = denoise(block, x_bytes, z, sigma_t, layout)
        if on_step is not None:
            on_step(n, block, sigma, logits)
        if n == len(grid) - 1:
            break
        if method == "euler":
            z = euler_step(z, logits, targets, sigma, grid[n + 1][1])
        else:
            assert generator is not None
            sigma_next = grid[n + 1][1]
            step: Callable[..., torch.Tensor] = functools.partial(
                ancestral_step, targets=targets, sigma_next=sigma_next
            )
            if fork is not None and n + 1 == fork.point:
                step = functools.partial(
                    fork_step,
                    targets=targets,
                    sigma_next=sigma_next,
                    draws=fork.draws,
                )
                layout = fork.layout
            z = _per_rows(step, logits, generator)
    return z, logits


def one_sweep(
    denoise: Denoiser,
    x_bytes: torch.Tensor,
    z: torch.Tensor,
    grid: list[tuple[int, float]],
    targets: torch.Tensor,
    layout: ZLayout,
    on_step: StepHook | None = None,
    *,
    method: str = "euler",
    generator: torch.Generator | None = None,
    fork: Fork | None = None,
) -> torch.Tensor:
    """Refine z (N, Lz, d), which starts as sigma_max * eps, through the whole grid; return the
    final logits (N, Lz', 256) (Lz' = fork.draws * Lz with a fork)."""
    if not grid:
        raise ValueError("the sigma grid is empty")
    return run_points(
        denoise,
        x_bytes,
        z,
        grid,
        targets,
        layout,
        method=method,
        generator=generator,
        on_step=on_step,
        fork=fork,
    )[1]


@torch.no_grad()
def generate(
    denoise: Denoiser,
    prompt: torch.Tensor,
    n_bytes: int,
    *,
    grid: list[tuple[int, float]],
    targets: torch.Tensor,
    span: int,
    max_context: int,
    sampling: Sampling,
    generator: torch.Generator,
    method: str = "euler",
) -> torch.Tensor:
    """Continue `prompt` (N, Lp) by n_bytes, one span of K bytes per sweep, the window at most
    `max_context` bytes (T - K) -> (N, n_bytes) int64."""
    check_sampler(method)
    loop = SpanLoop(
        prompt,
        n_bytes,
        span=span,
        max_context=max_context,
        d_model=targets.shape[1],
        sigma_max=grid[0][1],
        generator=generator,
    )
    out: list[torch.Tensor] = []
    while not loop.done:
        x, z = loop.next_input()
        layout = ZLayout.next_span(x.shape[1], span, device=x.device)
        logits = one_sweep(
            denoise,
            x,
            z.to(x.device),
            grid,
            targets,
            layout,
            method=method,
            generator=generator,
        )
        out.append(loop.push(sample_bytes(logits.cpu(), sampling, generator, prefix=x.cpu())))
    return torch.cat(out, dim=1)
