"""A block host's compute for sweeps: a batch of sweeps at the same grid point runs as one pass of
`model.sampler.run_points` over their rows (shared/batching.py gathers them), each block's clean
stream taken from the generation's cache as far as it holds the context (docs/serving.md,
"Batching, readiness and replicas"). The cache changes the cost, never the result beyond float
rounding; batched and unbatched sweeps follow one law: each request's rows see the layout, grid
and steps they would alone, and draw from the request's own generator."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

import torch

from blocktrain.model import Sampling, ZLayout, sample_bytes
from blocktrain.model.cached import CleanBatch, CleanCache, right_align
from blocktrain.model.sampler import RowGenerators, needs_generator, run_points
from blocktrain.model.speculative import verify_sweep_layout
from blocktrain.serving.host.loading import HostedModel
from blocktrain.serving.host.sessions import SessionStore
from blocktrain.serving.shared.wire import SweepHeader, bytes_tensor, encode

SweepKey = tuple[str, int, int, str, int, int, int, int, int]
"""What sweeps must share to run as one batch: model, grid point, steps per block, sampler,
drafted bytes, verify draws and their fork, state length (so one layout serves the batch), and
the bucket of the clean positions to compute (`fresh_bucket`). Context lengths may differ
(model/cached.py)."""


class SweepResult(NamedTuple):
    """One sweep's outcome on this host."""

    z: torch.Tensor
    step: int
    """The next grid point."""
    final: bytes | None
    """The final answer, when this host ran the grid's last point."""
    blocks: list[int]
    seconds: float
    """Compute seconds of its batch."""
    upstream: torch.Tensor | None = None
    """(n, Lx, d): the last block's clean output over the context, which the next block reads
    under `route = features` (None: it reads nothing but z, or this was the last point)."""


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
    session: str | None = None
    """The generation's clean-stream caches on this host (None: keep none)."""
    upstream: torch.Tensor | None = None
    """(n, Lx, d): the previous block's clean output, sent by the host before (`route =
    features` and a sweep that starts past block 0)."""


@dataclass
class CacheStats:
    """What the clean-stream caches saved, for /v1/info and the load bench: context positions
    run through a block, and those taken from a cache instead."""

    computed: int = 0
    reused: int = 0

    def describe(self) -> dict[str, int]:
        return {"positions_computed": self.computed, "positions_reused": self.reused}


def host_points(grid: list[tuple[int, float]], start: int, parts: Collection[int]) -> range:
    """The grid points a host runs from `start` on: the consecutive ones of its blocks."""
    stop = start
    while stop < len(grid) and grid[stop][0] in parts:
        stop += 1
    return range(start, stop)


def fresh_bucket(positions: int) -> int:
    """Sweeps that compute about as many clean positions batch together (0, 1, 2, 4, 8, ...):
    a batch computes its largest, so a prompt's first sweep (the whole context) must not make
    the sweeps that add one byte recompute theirs; within a bucket at most 2x."""
    return 0 if positions <= 0 else 1 << (positions - 1).bit_length()


def final_answer(
    logits: torch.Tensor,
    final: str,
    gen: torch.Generator | None,
    sampling: Sampling | None,
) -> bytes:
    """The last host's answer: logits, or bytes drawn here; with the advanced generator state
    whenever the request sent one."""
    if final != "bytes":
        out = {"logits": logits.float().contiguous()}  # encode moves it to the CPU
    else:
        assert gen is not None and sampling is not None
        out = {"bytes": bytes_tensor(sample_bytes(logits.cpu(), sampling, gen))}
    if gen is not None:
        out["generator"] = gen.get_state()
    return encode(out)


def reusable(
    jobs: list[SweepJob], blocks: list[int], sessions: SessionStore | None
) -> list[tuple[int, dict[int, CleanCache]]]:
    """Per job: how many leading context positions every one of `blocks` holds in its cache
    (compared byte by byte: nothing a caller claims is trusted), and those caches."""
    out = []
    for j in jobs:
        caches = (
            {}
            if sessions is None or j.session is None
            else sessions.clean(j.model.name, j.session, blocks)
        )
        held = [caches[b].reusable(j.x) if b in caches else 0 for b in blocks]
        out.append((min(held), caches))
    return out


@torch.no_grad()
def run_sweeps(
    jobs: list[SweepJob],
    compute: threading.Lock,
    sessions: SessionStore | None = None,
    stats: CacheStats | None = None,
) -> list[SweepResult]:
    """This host's consecutive points of the grid for `jobs` (same key), under `compute`: the
    contexts right-aligned in one batch, each block's clean stream taken from the jobs' caches
    in `sessions` as far as they hold it, and the caches kept for the jobs' next sweeps."""
    head = jobs[0]
    model, header, grid = head.model, head.header, head.grid
    stack = model.stack
    assert stack is not None
    points = host_points(grid, header.step, model.parts)
    visited = sorted({grid[n][0] for n in points})
    cfg = model.config.model
    # Under `route = features` each block but the last keeps its clean outputs: the next block
    # reads them, on this host or the next.
    passes = cfg.reads_upstream
    keeps_out = {b: passes and b < cfg.blocks - 1 for b in visited}
    rows = [j.x.shape[0] for j in jobs]
    gens: RowGenerators | None = None
    if needs_generator(header.sampler):  # the host checked that each such job sent one
        gens = [(n, j.gen) for n, j in zip(rows, jobs, strict=True) if j.gen is not None]
    with compute:
        t0 = time.perf_counter()
        held = reusable(jobs, visited, sessions)
        fresh = max(j.x.shape[1] - p for j, (p, _) in zip(jobs, held, strict=True))
        clean = {
            b: CleanBatch.gather(
                [
                    (j.x.shape[0], j.x.shape[1], c.get(b))
                    for j, (_, c) in zip(jobs, held, strict=True)
                ],
                fresh,
                layers=cfg.layers_per_block,
                heads=cfg.n_heads,
                head_dim=cfg.head_dim,
                out_dim=cfg.d_model if keeps_out[b] else None,
                device=model.device,
            )
            for b in visited
        }
        x, _ = right_align([j.x for j in jobs])
        upstream = {b: clean[b - 1].out for b in visited if passes and b - 1 in clean}
        if passes and visited[0] > 0:  # what the host before sent, right-aligned as x
            sent = [j.upstream for j in jobs if j.upstream is not None]
            assert len(sent) == len(jobs), "a sweep past block 0 of a features run without u"
            upstream[visited[0]] = right_align(sent)[0]
        if header.verifies:
            layout, fork = verify_sweep_layout(
                x.shape[1] - header.drafted,
                header.drafted,
                header.draws,
                header.fork,
                device=x.device,
            )
        else:
            layout, fork = ZLayout.next_span(x.shape[1], head.z.shape[1], device=x.device), None

        def denoise(
            b: int, xb: torch.Tensor, zb: torch.Tensor, sigma: torch.Tensor, lay: ZLayout
        ) -> torch.Tensor:
            return stack.block(b).forward_cached(xb, zb, sigma, lay, clean[b], upstream.get(b))

        z, logits = run_points(
            denoise,
            x,
            torch.cat([j.z for j in jobs]) if len(jobs) > 1 else head.z,
            grid,
            stack.targets,
            layout,
            start=points.start,
            stop=points.stop,
            method=header.sampler,
            generator=gens,
            fork=fork,
        )
        finals: list[bytes | None] = [None] * len(jobs)
        passed: list[torch.Tensor | None] = [None] * len(jobs)
        if points.stop == len(grid):
            finals = [
                final_answer(lj, j.header.final, j.gen, j.sampling)
                for j, lj in zip(jobs, logits.split(rows), strict=True)
            ]
        elif keeps_out[visited[-1]]:
            last = clean[visited[-1]]
            starts = [0, *itertools.accumulate(rows)][:-1]
            passed = [
                last.outputs(slice(a, a + n), j.x.shape[1])
                for j, a, n in zip(jobs, starts, rows, strict=True)
            ]
        if stats is not None:  # a row's own positions (padding is neither)
            for j in jobs:
                n, length = j.x.shape
                stats.computed += min(fresh, length) * n * len(visited)
                stats.reused += max(0, length - fresh) * n * len(visited)
        if sessions is not None:
            keep(jobs, visited, clean, sessions)
        seconds = time.perf_counter() - t0
    return [
        SweepResult(zj, points.stop, f, visited, seconds, u)
        for zj, f, u in zip(z.split(rows), finals, passed, strict=True)
    ]


def keep(
    jobs: list[SweepJob],
    blocks: list[int],
    clean: dict[int, CleanBatch],
    sessions: SessionStore,
) -> None:
    """Each job's caches of `blocks` for its next sweep, or none after its last (`close`)."""
    contexts = [j.x for j in jobs]
    split = {b: clean[b].split(contexts) for b in blocks}
    for i, j in enumerate(jobs):
        if j.session is None:
            continue
        if j.header.close:
            sessions.close(j.model.name, j.session, blocks)
        else:
            sessions.keep(j.model.name, j.session, {b: split[b][i] for b in blocks})
