"""The router's generation loops over a `Chain`, each yielding the new bytes as they come: the
loops of `model.sampler.generate` (`SpanLoop`, a traversal per span), of
`model.speculative.generate_speculative` (`SpeculativeLoop`) and the autoregressive pipeline's
(a traversal per byte), with the sweep or step run by the chain of hosts.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import torch

from blocktrain.model import Sampling
from blocktrain.model.span_loop import SpanLoop
from blocktrain.model.speculative import SpeculativeLoop
from blocktrain.serving.router.chain import Chain
from blocktrain.serving.shared.serving_errors import SessionLost

log = logging.getLogger(__name__)


async def one_sweep_stream(
    chain: Chain,
    prompt: torch.Tensor,
    n_bytes: int,
    *,
    sampling: Sampling,
    generator: torch.Generator,
    steps_per_block: int,
    sampler: str,
) -> AsyncIterator[torch.Tensor]:
    """Continue prompt (N, Lp) by n_bytes; yields each span's new bytes (N, <= K) as soon as its
    sweep returns (the loop and sweep of model.sampler.generate)."""
    cfg = chain.model.config.model
    loop = SpanLoop(
        prompt,
        n_bytes,
        span=cfg.span,
        max_context=cfg.seq_len - cfg.span,
        d_model=cfg.d_model,
        sigma_max=cfg.sigma_max,  # == the grid's first point, exactly
        generator=generator,
    )
    async with chain.session() as session:  # the hosts cache the clean streams under it
        while not loop.done:
            x, z = loop.next_input()
            last = loop.produced + loop.span >= loop.n_bytes
            new = await chain.sweep(
                x,
                z,
                steps_per_block=steps_per_block,
                sampler=sampler,
                sampling=sampling,
                generator=generator,
                session=session.name,
                close=last,
            )  # (N, K)
            session.closed = last
            yield loop.push(new)


async def speculative_stream(
    chain: Chain, loop: SpeculativeLoop, *, steps_per_block: int, sampler: str
) -> AsyncIterator[torch.Tensor]:
    """Run `loop` with the chain's K = 1 model as the verifier; yields the 1..D + 1 bytes each
    traversal emits."""
    cfg = chain.model.config.model
    async with chain.session() as session:  # the hosts cache the clean streams under it
        while not loop.done:
            draft = loop.next_draft()
            x, z, _ = loop.sweep_input(draft, cfg.d_model, cfg.sigma_max)
            logits = await chain.verify(
                x,
                z,
                drafted=len(draft),
                draws=loop.draws,
                fork=loop.fork,
                steps_per_block=steps_per_block,
                sampler=sampler,
                sampling=loop.sampling,
                generator=loop.generator,
                # Never `close`: which sweep is the last depends on its acceptances, and a
                # sweep after a closed one would recompute its context. Released at the end.
                session=session.name,
            )
            yield loop.push(logits)


async def autoregressive_stream(
    chain: Chain,
    prompt: torch.Tensor,
    n_bytes: int,
    *,
    sampling: Sampling,
    generator: torch.Generator,
) -> AsyncIterator[torch.Tensor]:
    """Continue prompt (N, Lp) by n_bytes, one traversal per byte; yields each byte (N, 1).
    The stages' caches hold at most T positions: the first step prefills the prompt's last T
    bytes, and a full cache restarts from the last T/2 (so the context is T/2 to T bytes, where
    `generate_autoregressive` always sees T). A stage that lost its cache makes the router
    prefill again, under the same session name (a step at position 0 replaces the caches)."""
    if prompt.shape[1] == 0:
        raise ValueError("the prompt must hold at least one byte")
    window = chain.model.config.model.seq_len
    context = prompt
    pos = 0
    pending = context[:, -window:]
    async with chain.session() as session:
        for i in range(n_bytes):
            if pos + pending.shape[1] > window:
                pos, pending = 0, context[:, -(window // 2) :]
            for attempt in (0, 1):  # once more from a fresh prefill if a host lost its cache
                try:
                    new = await chain.stage_step(
                        pending,
                        session=session.name,
                        pos=pos,
                        close=i == n_bytes - 1,
                        sampling=sampling,
                        generator=generator,
                        context=context,
                    )
                    break
                except SessionLost as exc:
                    if attempt:
                        raise
                    log.info("prefilling again: %s", exc)
                    pos, pending = 0, context[:, -(window // 2) :]
            session.closed = i == n_bytes - 1
            pos += pending.shape[1]
            pending = new[:, None]
            context = torch.cat((context, pending), dim=1)
            yield pending


async def autoregressive_speculative_stream(
    chain: Chain, loop: SpeculativeLoop
) -> AsyncIterator[torch.Tensor]:
    """Run `loop` with the autoregressive pipeline as the verifier (the same drafter, so the
    comparison stays fair): the last stage answers the logits of the D + 1 last positions, and
    the hosts cut their caches back past the accepted bytes at the next step."""
    window = chain.model.config.model.seq_len
    pos = 0
    pending = loop.context[-window:]
    async with chain.session() as session:
        while not loop.done:
            draft = loop.next_draft()
            if pos + len(pending) + len(draft) > window:
                pos, pending = 0, loop.context[-(window // 2) :]
            last = len(draft) == loop.n_bytes - loop.produced - 1  # emits all wanted, at best
            for attempt in (0, 1):  # once more from a fresh prefill if a host lost its cache
                try:
                    logits = await chain.stage_verify(
                        torch.tensor([pending + draft]),
                        session=session.name,
                        pos=pos,
                        close=last,
                        drafted=len(draft),
                    )
                    break
                except SessionLost as exc:
                    if attempt:
                        raise
                    log.info("prefilling again: %s", exc)
                    pos, pending = 0, loop.context[-(window // 2) :]
            session.closed = last
            new = loop.push(logits)
            if last:  # closed: a further step (fewer bytes accepted) opens a fresh session
                pos, pending = 0, loop.context[-(window // 2) :]
            else:  # cached: the pending bytes and the accepted drafts; not yet the last byte
                pos += len(pending) + new.shape[1] - 1
                pending = new[0, -1:].tolist()
            yield new
