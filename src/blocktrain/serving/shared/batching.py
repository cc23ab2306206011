"""Batching: jobs that arrive together and share a key run as one batch (docs/serving.md,
"Batching, readiness and replicas"). A batch waits at most `window_s` after its oldest job
unless its bucket holds `max_rows` rows; one batch computes at a time per batcher, oldest bucket
first, in a worker thread (so that the event loop keeps answering), or awaited on the loop when
`run` is a coroutine function (the router's coalescing). `max_rows = 1` runs every job alone,
through the same code.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import anyio.to_thread

K = TypeVar("K", bound=Hashable)
J = TypeVar("J")
R = TypeVar("R")


@dataclass
class _Pending(Generic[J]):
    rows: int
    job: J
    future: asyncio.Future[Any]
    arrived: float


@dataclass
class BatchStats:
    """What the batcher did, for /v1/info and the load bench."""

    batches: int = 0
    jobs: int = 0
    rows: int = 0
    largest: int = 0
    """Most jobs in one batch."""

    def add(self, jobs: int, rows: int) -> None:
        self.batches += 1
        self.jobs += jobs
        self.rows += rows
        self.largest = max(self.largest, jobs)

    def describe(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "jobs": self.jobs,
            "rows": self.rows,
            "largest": self.largest,
            "mean_jobs": self.jobs / self.batches if self.batches else 0.0,
        }


class Batcher(Generic[K, J, R]):
    """Runs `run(key, jobs) -> results` (one result per job, in order) on batches of the jobs
    submitted under the same key."""

    def __init__(
        self,
        run: Callable[[K, list[J]], list[R]] | Callable[[K, list[J]], Awaitable[list[R]]],
        *,
        window_s: float,
        max_rows: int,
    ) -> None:
        if window_s < 0 or max_rows < 1:
            raise ValueError(f"window {window_s} s must be >= 0 and max rows {max_rows} >= 1")
        self.run, self.window_s, self.max_rows = run, window_s, max_rows
        self._async = inspect.iscoroutinefunction(run)
        self.stats = BatchStats()
        self._buckets: dict[K, list[_Pending[J]]] = {}
        self._drainer: asyncio.Task[None] | None = None

    async def submit(self, key: K, rows: int, job: J) -> R:
        """Queue `job` (of `rows` sequences) and wait for its result (or its batch's error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._buckets.setdefault(key, []).append(_Pending(rows, job, future, loop.time()))
        if self._drainer is None or self._drainer.done():
            # Started by whoever finds it idle, and ends once the queue is empty: no task
            # outlives the work, whatever event loop the app runs on.
            self._drainer = loop.create_task(self._drain())
        return await future

    def _take(self, key: K) -> list[_Pending[J]]:
        """The oldest jobs of a bucket up to max_rows rows (at least one job)."""
        bucket = self._buckets.pop(key)
        rows, n = 0, 0
        while n < len(bucket) and (n == 0 or rows + bucket[n].rows <= self.max_rows):
            rows += bucket[n].rows
            n += 1
        if n < len(bucket):
            self._buckets[key] = bucket[n:]  # to the back: the other buckets go first
        return bucket[:n]

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._buckets:
            key = next(iter(self._buckets))  # the bucket waiting longest
            bucket = self._buckets[key]
            wait = bucket[0].arrived + self.window_s - loop.time()
            if wait > 0 and sum(p.rows for p in bucket) < self.max_rows:
                await asyncio.sleep(wait)
                continue  # the buckets may have changed meanwhile
            batch = [p for p in self._take(key) if not p.future.done()]  # not abandoned
            if not batch:
                continue
            self.stats.add(len(batch), sum(p.rows for p in batch))
            try:
                jobs = [p.job for p in batch]
                if self._async:
                    results = await cast(Awaitable[list[R]], self.run(key, jobs))
                else:
                    run = cast(Callable[[K, list[J]], list[R]], self.run)
                    results = await anyio.to_thread.run_sync(run, key, jobs)
            except Exception as exc:  # the batch's error is each of its jobs' error
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, result in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(result)
