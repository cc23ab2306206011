"""Generation by spans: where each sweep's context window starts (``window_start``) and the
bookkeeping of the loop (``SpanLoop``), shared by ``model.sampler.generate`` and the router so
that a local and a remote generation draw the same numbers in the same order."""

from __future__ import annotations

import torch


def window_start(length: int, start: int, capacity: int) -> int:
    """Where a generation's context window starts, given its context's `length` and the
    window's current `start`: it stays put while the context fits in `capacity` bytes from it
    (so the hosts' clean-stream caches hold), then restarts at the last capacity // 2 bytes. A
    sweep so recomputes its context once per capacity // 2 new bytes, not at every sweep."""
    if length - start <= capacity:
        return start
    return length - max(1, capacity // 2)


def first_window(length: int, capacity: int) -> int:
    """The start of a generation's first window: its prompt's last `capacity` bytes."""
    return max(0, length - capacity)


class SpanLoop:
    """The bookkeeping of generation by spans, shared by `generate` and the router so that both
    draw the same numbers in the same order: per span, the window (`window_start`), the noise
    z = sigma_max * eps from the request's generator on the CPU (results do not depend on the
    device), the sweep (which may draw too), the bytes sampled from the final logits.

        loop = SpanLoop(prompt, n, ...)
        while not loop.done:
            x, z = loop.next_input()
            emitted = loop.push(new)   # new: (N, K) sampled from one sweep of (x, z)
    """

    def __init__(
        self,
        prompt: torch.Tensor,
        n_bytes: int,
        *,
        span: int,
        max_context: int,
        d_model: int,
        sigma_max: float,
        generator: torch.Generator,
    ) -> None:
        if prompt.shape[1] == 0:
            raise ValueError("the prompt must hold at least one byte")
        if max_context < 1:
            raise ValueError(f"a span of K = {span} leaves no context (T - K = {max_context})")
        self.context = prompt  # (N, Lp + produced)
        self.n_bytes, self.span, self.max_context = n_bytes, span, max_context
        self.d_model, self.sigma_max, self.generator = d_model, sigma_max, generator
        self.produced = 0
        self.start = first_window(prompt.shape[1], max_context)

    @property
    def done(self) -> bool:
        return self.produced >= self.n_bytes

    def next_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x (N, Lx) the context's window, at most max_context bytes, z (N, K, d) fp32 at
        sigma_max, CPU)."""
        self.start = window_start(self.context.shape[1], self.start, self.max_context)
        x = self.context[:, self.start :]
        noise = torch.randn(x.shape[0], self.span, self.d_model, generator=self.generator)
        return x, self.sigma_max * noise

    def push(self, new: torch.Tensor) -> torch.Tensor:
        """Append a span's bytes (N, K); -> the part of it that is wanted (N, <= K)."""
        new = new.to(self.context.device)
        self.context = torch.cat((self.context, new), dim=1)
        wanted = new[:, : self.n_bytes - self.produced]
        self.produced += self.span
        return wanted
