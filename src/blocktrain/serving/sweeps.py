"""A block host's compute for sweeps: a batch of sweeps that share a grid point and shapes runs as
one pass of `model.sampler.run_points` over their rows together (batching.py gathers them), and
the last host's answer (logits, or bytes drawn with the request's own generator).

Batched and unbatched sweeps follow one law: the rows of one request see the same layout, the
same grid points and the same steps as they would alone; a step that draws noise (ancestral)
draws each request's rows from its own generator, and so does the final sampling, so every
request's randomness stays its own whatever it was batched with."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from blocktrain.model import Sampling, ZLayout, sample_bytes
from blocktrain.model.sampler import RowGenerators, needs_generator, run_points, stack_denoiser
from blocktrain.model.speculative import verify_layout
from blocktrain.serving.loading import HostedModel
from blocktrain.serving.wire import SweepHeader, bytes_tensor, encode

SweepKey = tuple[str, int, int, str, int, int, int]
"""What sweeps must share to run as one batch: model, grid point, steps per block, sampler,
drafted bytes, context length, state length."""
SweepResult = tuple[torch.Tensor, int, bytes | None, list[int], float]
"""Per sweep: (z, next step, the final answer or None, blocks run, compute seconds of its
batch)."""


@dataclass(frozen=True)
class SweepJob:
    """One validated sweep request waiting for its batch."""

    model: HostedModel
    header: SweepHeader
    x: torch.Tensor  # (n, Lx) context bytes
    z: torch.Tensor  # (n, Lz, d) the state at grid point header.step
    grid: list[tuple[int, float]]
    gen: torch.Generator | None
    sampling: Sampling | None


def final_answer(
    logits: torch.Tensor,
    final: str,
    gen: torch.Generator | None,
    sampling: Sampling | None,
) -> bytes:
    """The last host's answer: logits, or bytes drawn here; with the advanced generator state
    whenever the request sent one."""
    if final != "bytes":
        out = {"logits": logits.float().contiguous()}
    else:
        assert gen is not None and sampling is not None
        out = {"bytes": bytes_tensor(sample_bytes(logits.cpu(), sampling, gen))}
    if gen is not None:
        out["generator"] = gen.get_state()
    return encode(out)


@torch.no_grad()
def run_sweeps(jobs: list[SweepJob], compute: threading.Lock) -> list[SweepResult]:
    """This host's consecutive points of the grid for `jobs` (same key), under `compute`."""
    head = jobs[0]
    model, header, grid = head.model, head.header, head.grid
    assert model.stack is not None
    start = stop = header.step
    while stop < len(grid) and grid[stop][0] in model.parts:
        stop += 1
    visited = sorted({grid[n][0] for n in range(start, stop)})
    x = torch.cat([j.x for j in jobs]) if len(jobs) > 1 else head.x
    z = torch.cat([j.z for j in jobs]) if len(jobs) > 1 else head.z
    if header.drafted:
        layout = verify_layout(x.shape[1] - header.drafted, header.drafted, device=x.device)
    else:
        layout = ZLayout.next_span(x.shape[1], z.shape[1], device=x.device)
    rows = [j.x.shape[0] for j in jobs]
    gens: RowGenerators | None = None
    samplings: list[Sampling] = []  # each request's, for the steps that draw bytes (reveal)
    if needs_generator(header.sampler):  # the host checked that each such job sent one
        gens = [(n, j.gen) for n, j in zip(rows, jobs, strict=True) if j.gen is not None]
        samplings = [j.sampling or Sampling() for j in jobs if j.gen is not None]
    with compute:
        t0 = time.perf_counter()
        z, logits = run_points(
            stack_denoiser(model.stack),
            x,
            z,
            grid,
            model.stack.targets,
            layout,
            start=start,
            stop=stop,
            method=header.sampler,
            generator=gens,
            sampling=samplings,
        )
        finals: list[bytes | None] = [None] * len(jobs)
        if stop == len(grid):
            finals = [
                final_answer(lj, j.header.final, j.gen, j.sampling)
                for j, lj in zip(jobs, logits.split(rows), strict=True)
            ]
        seconds = time.perf_counter() - t0
    return [(zj, stop, f, visited, seconds) for zj, f in zip(z.split(rows), finals, strict=True)]
