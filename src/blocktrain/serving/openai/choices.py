"""The generation behind the OpenAI routes: the `n` choices of one request, each its own sample
(choice i draws from seed + i), run concurrently over the chain, each ending at its first stop
sequence (finish "stop") or its byte budget ("length"). docs/serving.md, "The OpenAI API".
A choice that keeps to UTF-8 ends its pieces at character boundaries, and its logprobs are those
of the constrained law each byte was drawn from."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from blocktrain.model import Sampling, utf8
from blocktrain.model.sampling import sampling_probs
from blocktrain.serving.openai.schemas import Hop, OpenAIParams, Timings, Usage
from blocktrain.serving.router.chain_router import Job, Router
from blocktrain.serving.router.generate_schemas import Prompt
from blocktrain.serving.router.traversal import ChainStats
from blocktrain.serving.shared.serving_errors import BadRequest

Finish = Literal["stop", "length"]


def choice_seed(seed: int, index: int) -> int:
    """The seed choice `index` draws from: the request's seed for choice 0."""
    return (seed + index) % 2**63


def byte_token(b: int) -> str:
    """One byte as a token's text: itself when ASCII, else a `bytes:\\xNN` escape (a byte of a
    multi-byte character is no text of its own)."""
    return chr(b) if b < 0x80 else f"bytes:\\x{b:02x}"


def log_distribution(
    logits: torch.Tensor, sampling: Sampling, states: torch.Tensor | None = None
) -> torch.Tensor:
    """logits (L, 256) -> log-probabilities (L, 256) of the law each byte was drawn from (the
    UTF-8 constraint in `states` (L,), None: none; temperature, top-k, top-p). Greedy draws from
    a point mass, which tells nothing, so at temperature 0 this is the model's own law."""
    if states is not None:
        logits = utf8.mask_logits(logits, states)
    if sampling.temperature == 0:
        return logits.float().log_softmax(dim=-1)
    return sampling_probs(logits, sampling).log()


@dataclass(frozen=True)
class ByteLogprob:
    byte: int
    logprob: float
    top: list[tuple[int, float]]
    """The likeliest bytes at this position, likeliest first (none outside top-k/top-p)."""


def byte_logprob(dist: torch.Tensor, byte: int, top: int) -> ByteLogprob:
    values, order = dist.topk(top) if top else (dist[:0], dist[:0].long())
    alternatives = [
        (int(b), float(v)) for b, v in zip(order.tolist(), values.tolist(), strict=True)
    ]
    return ByteLogprob(byte, float(dist[byte]), [a for a in alternatives if a[1] > -float("inf")])


@dataclass(frozen=True)
class Piece:
    """Bytes of one choice as they come; the last piece of a choice has its finish reason."""

    index: int
    data: bytes
    logprobs: list[ByteLogprob]
    finish: Finish | None


def prefix_function(s: bytes) -> list[int]:
    """KMP's failure function: f[i] is the length of the longest proper prefix of s[: i + 1]
    that is also a suffix of it. O(len(s))."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopScanner:
    """Cuts a choice's bytes at the first stop sequence, holding back the bytes that could begin
    one until the next bytes settle it, so that no part of a stop sequence is ever sent.
    Linear time: each stop sequence keeps its KMP state, so a piece costs O(len(piece)) steps
    per stop (amortized); the held bytes are at most the longest stop less one byte."""

    def __init__(self, stops: list[bytes]) -> None:
        self.stops = stops
        self.fail = [prefix_function(s) for s in stops]
        self.state = [0] * len(stops)
        self.buf = b""

    def push(self, data: bytes) -> tuple[bytes, bool]:
        """-> (the bytes safe to send, whether a stop sequence ended the choice)."""
        base, buf = len(self.buf), self.buf + data
        first: int | None = None  # where the earliest stop sequence found starts, in buf
        for j, (s, f) in enumerate(zip(self.stops, self.fail, strict=True)):
            q = self.state[j]
            for i, b in enumerate(data):
                while q and s[q] != b:
                    q = f[q - 1]
                if s[q] == b:
                    q += 1
                if q == len(s):  # the first match of s: the earliest-starting one of s
                    start = base + i + 1 - len(s)
                    first = start if first is None else min(first, start)
                    break
            self.state[j] = q
        if first is not None:
            self.buf, self.state = b"", [0] * len(self.stops)
            return buf[:first], True
        hold = max(self.state, default=0)  # a state <= the held bytes + the new: <= len(buf)
        out, self.buf = buf[: len(buf) - hold], buf[len(buf) - hold :]
        return out, False

    def flush(self) -> bytes:
        out, self.buf, self.state = self.buf, b"", [0] * len(self.stops)
        return out


class CharacterBoundary:
    """Holds back the bytes of a character not yet complete (each piece ends at a character
    boundary); at the end, what is still held (cut short by the budget) is dropped."""

    def __init__(self, state: int) -> None:
        self.state = state
        """The automaton's state where the bytes sent so far end (after the prompt at first)."""
        self.held = b""

    def push(self, data: bytes) -> bytes:
        buf = self.held + data
        cut = utf8.complete_length(buf, self.state)
        if cut:
            self.state = utf8.ACCEPT
        self.held = buf[cut:]
        return buf[:cut]

    def end(self, data: bytes) -> bytes:
        out = self.push(data)
        self.held = b""
        return out


class Text:
    """A choice's bytes as text, decoded as they come (UTF-8, invalid sequences replaced), and
    each byte's character offset in it (a byte inside a character has that character's)."""

    def __init__(self, offset: int = 0) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = offset

    def feed(self, data: bytes, final: bool = False) -> tuple[str, list[int]]:
        parts, offsets = [], []
        for b in data:
            offsets.append(self.chars)
            parts.append(self.decoder.decode(bytes([b])))
            self.chars += len(parts[-1])
        if final:
            parts.append(self.decoder.decode(b"", final=True))
            self.chars += len(parts[-1])
        return "".join(parts), offsets


@dataclass
class Run:
    """One OpenAI request's choices on the chain, and what they cost."""

    router: Router
    job: Job
    prompt: bytes
    n: int
    stops: list[bytes]
    top_logprobs: int | None
    """None: no logprobs; k: each byte's and the k likeliest."""
    arrived: float
    stats: list[ChainStats] = field(default_factory=list)
    made: int = 0
    """Bytes the chain generated, all choices together."""
    started: float | None = None
    first: float | None = None
    parked: bool = False
    """Its work is out of the work in flight while its stream waits for the client (`park`)."""
    ended: bool = False
    """Its work was released for good (`done`)."""

    def pieces(self) -> AsyncGenerator[Piece]:
        """The choices' pieces, interleaved as they come."""
        self.started = time.perf_counter()
        return interleave([self._choice(i) for i in range(self.n)])

    async def _choice(self, index: int) -> AsyncIterator[Piece]:
        job = dataclasses.replace(self.job, seed=choice_seed(self.job.seed, index))
        stats = ChainStats(logits=[] if self.top_logprobs is not None else None)
        self.stats.append(stats)
        scanner, generated, sent = StopScanner(self.stops), bytearray(), 0
        dists: list[torch.Tensor] = []
        start = utf8.state_after(self.prompt)
        boundary = CharacterBoundary(start) if job.sampling.utf8 else None
        law_state = start  # UTF-8: the state before the byte of the next logits row

        def constraint(rows: int) -> torch.Tensor | None:
            """The UTF-8 state of each of the next `rows` logits rows (row p: the byte at p)."""
            nonlocal law_state
            if boundary is None:
                return None
            states = []
            for p in range(len(dists), len(dists) + rows):
                states.append(law_state)
                if p < len(generated):
                    law_state = utf8.step(law_state, generated[p])
            return torch.tensor(states, dtype=torch.long)

        def piece(data: bytes, finish: Finish | None) -> Piece:
            nonlocal sent
            if boundary is not None:
                data = boundary.push(data) if finish is None else boundary.end(data)
            if stats.logits:  # the traversals' logits so far: their bytes' distributions
                flat = torch.cat([t.reshape(-1, t.shape[-1]) for t in stats.logits])
                dists.extend(log_distribution(flat, job.sampling, constraint(len(flat))).unbind(0))
                stats.logits.clear()
            top = self.top_logprobs
            logprobs = [
                byte_logprob(dists[p], generated[p], top)
                for p in range(sent, sent + len(data))
                if top is not None
            ]
            sent += len(data)
            return Piece(index, data, logprobs, finish)

        stream = self.router.stream(job, stats)
        try:
            async for new in stream:
                self.first = self.first or time.perf_counter()
                data = bytes(new[0].tolist())
                generated += data
                self.made += len(data)
                out, stopped = scanner.push(data)
                if stopped:
                    yield piece(out, "stop")
                    return
                if out:
                    sending = piece(out, None)
                    if sending.data:
                        yield sending
            yield piece(scanner.flush(), "length")
        finally:  # stopped early or cancelled: the loop ends now (a host's cache expires)
            if isinstance(stream, AsyncGenerator):
                await stream.aclose()

    def usage(self) -> Usage:
        """Tokens are bytes; completion tokens count every byte the chain generated, a stop
        sequence and the rest of its span included."""
        return Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=self.made,
            total_tokens=len(self.prompt) + self.made,
        )

    def timings(self) -> Timings:
        now = time.perf_counter()
        started = self.started or now
        # every host in route order, with 0 for one that computed nothing; a position with
        # replicas lists those that served (the trace names the replica that answered)
        hops: dict[str, float] = {r[0]: 0.0 for r in self.job.model.replicas if len(r) == 1}
        for s in self.stats:
            for host, ms in s.host_ms.items():
                hops[host] = hops.get(host, 0.0) + ms
        return Timings(
            queue_ms=(started - self.arrived) * 1000,
            prefill_ms=((self.first or now) - started) * 1000,
            total_ms=(now - self.arrived) * 1000,
            chain_ms=sum(s.chain_s for s in self.stats) * 1000,
            host_compute_ms=sum(s.host_compute_s for s in self.stats) * 1000,
            traversals=sum(s.traversals for s in self.stats),
            hops=[Hop(host=h, compute_ms=ms) for h, ms in hops.items()],
        )

    def done(self) -> None:
        if not self.ended:
            self.router.done(self.job, self.parked)
            self.ended = True

    def park(self) -> None:
        """Give the work back while the client reads nothing (the choices wait for it)."""
        if not (self.parked or self.ended):
            self.router.park(self.job)
            self.parked = True

    def resume(self) -> bool:
        """Take the parked work again -> whether it fits now (then the choices go on)."""
        if self.parked and self.router.resume(self.job):
            self.parked = False
        return not self.parked


async def start_run(
    router: Router,
    req: OpenAIParams,
    *,
    prompt: Prompt,
    n_bytes: int,
    param: str,
    top_logprobs: int | None,
    arrived: float,
    client: str = "",
    address: str | None = None,
) -> Run:
    """Validate a request and admit its work (n choices of n_bytes); `Run.done` releases it."""
    if top_logprobs is not None:
        why = None
        if router.settings.sample_on != "router":
            why = (
                "logprobs need the router to sample (this one runs with --set sample_on=last-host)"
            )
        elif req.draft_bytes:
            why = "logprobs are not reported for speculative generation (draft_bytes > 0)"
        if why:
            raise BadRequest(why, param="logprobs")
    job = await router.job(
        model=req.model,
        prompt=prompt,
        n_bytes=n_bytes,
        param=param,
        req=req,
        choices=req.n,
        logprobs=top_logprobs is not None,
        client=client,
        address=address,
    )
    return Run(
        router,
        job,
        job.prompt,
        req.n,
        [s.encode("utf-8") for s in req.stops()],
        top_logprobs,
        arrived,
    )


async def interleave(gens: list[AsyncIterator[Piece]]) -> AsyncGenerator[Piece]:
    """The items of several async iterators, run concurrently, in the order they come; the
    first failure is raised here, and every iterator still running is cancelled when this ends.
    The queue holds one item per iterator, so that a stream whose client stopped reading
    computes nothing."""
    queue: asyncio.Queue[tuple[Piece | None, Exception | None]] = asyncio.Queue(len(gens))

    async def pump(gen: AsyncIterator[Piece]) -> None:
        try:
            async for item in gen:
                await queue.put((item, None))
        except Exception as exc:  # raised where the items are read
            await queue.put((None, exc))
            return
        await queue.put((None, None))

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        running = len(tasks)
        while running:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
