"""Speculative generation with a K = 1 stack: D bytes drafted cheaply, verified (and one more
drawn) in ONE sweep by Leviathan et al.'s rule (arXiv 2211.17192; Chen et al., arXiv 2302.01318)
against a target whose law is a mixture over the sweep's noise. docs/serving.md, "Speculative
generation", has the layout, the M verify draws, their fork and their antithetic pairs.

Why the text is exact: each z_i starts from noise independent of the draft, so the lemma holds
per sweep noise and then averaged over it; the mean p_bar of M draws (forked or not) keeps
E p_bar = q, and the draws need to be independent of the draft only, not of each other. Why M
draws: E sum min(p, r) <= sum min(q, r) (min is concave), so one sweep's noise costs acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from blocktrain.model import utf8
from blocktrain.model.block import ZLayout
from blocktrain.model.cached import KVCache
from blocktrain.model.pipeline import split_reference
from blocktrain.model.reference import Reference
from blocktrain.model.sampler import Denoiser, Fork, antithetic_normal, one_sweep
from blocktrain.model.sampling import Sampling, sampling_probs
from blocktrain.model.span_loop import first_window, window_start

DEFAULT_VERIFY_DRAWS = 4
"""Noise draws M of a one-sweep verify sweep. More draws accept more bytes a traversal but cost
compute on every host; M = 4 (antithetic) was the fastest of those measured, where more bought
too few bytes for their time. The figures: BENCHMARKS.md, "Speculative K = 1: bytes per verify
traversal", and docs/research/spans.md, "Span generation: speed and quality"."""
MAX_VERIFY_DRAWS = 16


def check_verify_draws(draws: int) -> int:
    if not 1 <= draws <= MAX_VERIFY_DRAWS:
        raise ValueError(f"verify_draws = {draws} must lie in 1..{MAX_VERIFY_DRAWS}")
    return draws


def verify_fork(points: int, method: str, draws: int) -> int:
    """The grid point (of `points`) where a verify sweep's M = draws copies part: the last one
    under the ancestral sampler; 0 (M sweeps from M noises) under Euler, or with one draw."""
    return points - 1 if method == "ancestral" and draws > 1 and points > 1 else 0


class Drafter(Protocol):
    """Drafts bytes and says the law it drew each one from (NgramDrafter, ModelDrafter)."""

    def draft(
        self, context: list[int], n: int, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]:
        """n bytes -> (the bytes, their laws (n, 256))."""
        ...


class ModelDrafter:
    """A small autoregressive byte model (a `--reference` run) as the drafter, at temperature 1
    (the law the rule needs): one pass over the context's last T - n bytes, then one cached
    token per byte, so each drafted byte sees at most the model's T bytes."""

    def __init__(self, model: Reference) -> None:
        self.seq_len = model.cfg.seq_len
        self.stage = split_reference(model, 1)[0]
        self.device = next(model.parameters()).device
        with torch.no_grad():  # the first forward pass of a process is slow: not a request's
            self.stage(torch.zeros(1, 1, dtype=torch.long, device=self.device))

    @torch.no_grad()
    def draft(
        self, context: list[int], n: int, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]:
        laws = torch.zeros(n, 256, dtype=torch.float64)
        if n == 0:
            return [], laws
        cache = KVCache()
        window = context[-max(1, self.seq_len - n) :]
        logits = self.stage(torch.tensor([window], device=self.device), cache)[0, -1]
        drafted: list[int] = []
        for i in range(n):
            laws[i] = torch.softmax(logits.double().cpu(), dim=-1)
            drafted.append(int(torch.multinomial(laws[i], 1, generator=generator)))
            if i < n - 1:
                new = torch.tensor([[drafted[-1]]], device=self.device)
                logits = self.stage(new, cache)[0, -1]
        return drafted, laws


def verify_layout(
    context_len: int, drafted: int, draws: int = 1, device: torch.device | str = "cpu"
) -> ZLayout:
    """z tokens at positions P..P+D, `draws` times over: z_i sees the context and d_<i and
    itself only, so a position's draws are independent sweeps sharing one clean stream."""
    pos = torch.arange(context_len, context_len + drafted + 1, device=device).repeat(draws)
    to_x = torch.arange(context_len + drafted, device=device)[None, :] < pos[:, None]
    to_z = torch.eye(len(pos), dtype=torch.bool, device=device)
    return ZLayout(pos, pos, torch.cat((to_x, to_z), dim=1))


def verify_sweep_layout(
    context_len: int,
    drafted: int,
    draws: int,
    fork: int,
    device: torch.device | str = "cpu",
) -> tuple[ZLayout, Fork | None]:
    """The layout a verify sweep starts under, and its Fork (None: the draws start apart)."""
    copies = verify_layout(context_len, drafted, draws, device=device)
    if not fork:
        return copies, None
    one = verify_layout(context_len, drafted, device=device)
    return one, Fork(fork, draws, copies)


def accept_draft(
    draft: list[int], laws: torch.Tensor, probs: torch.Tensor, generator: torch.Generator
) -> list[int]:
    """draft (D,) drawn from laws (D, 256); probs (D + 1, 256) the sampler's distributions at
    the D + 1 verified positions -> the 1..D + 1 emitted bytes."""
    out: list[int] = []
    for i, byte in enumerate(draft):
        p, r = probs[i].double(), laws[i].double()
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(r[byte]) < float(p[byte]):  # u < p/r, written without dividing by r
            out.append(byte)
            continue
        residual = (p - r).clamp(min=0)
        if float(residual.sum()) <= 0:  # p <= r everywhere means p == r: cannot reject
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)].double(), 1, generator=generator)))
    return out


class SpeculativeLoop:
    """The bookkeeping of speculative generation for one sequence, shared by the in-process
    loops and the router's so that all draw the same numbers in the same order: the draft, the
    noise of the D + 1 z tokens (one-sweep model), the verify pass, the acceptance draws.

        loop = SpeculativeLoop(prompt, n, ...)
        while not loop.done:
            draft = loop.next_draft()
            x, z, context_len = loop.sweep_input(draft, d_model, sigma_max)   # one-sweep model
            emitted = loop.push(logits)   # the verifier's (1, M (D + 1), 256)
    """

    def __init__(
        self,
        prompt: torch.Tensor,
        n_bytes: int,
        *,
        drafter: Drafter,
        draft_len: int,
        seq_len: int,
        sampling: Sampling,
        generator: torch.Generator,
        draws: int = 1,
        fork: int = 0,
    ) -> None:
        if prompt.shape[0] != 1 or prompt.shape[1] == 0:
            raise ValueError("speculative generation takes one prompt of at least one byte")
        if not 0 <= draft_len <= seq_len - 2:
            raise ValueError(f"draft_len = {draft_len} must lie in 0..T - 2 = {seq_len - 2}")
        self.context: list[int] = prompt[0].tolist()
        self.n_bytes, self.draft_len, self.seq_len = n_bytes, draft_len, seq_len
        self.draws = check_verify_draws(draws)
        self.fork = fork
        """The grid point where the draws part (verify_fork); 0: they start apart."""
        self.drafter, self.sampling, self.generator = drafter, sampling, generator
        self.produced = self.traversals = self.drafted = 0
        # The window leaves room for the longest draft: context + draft <= T - 1 bytes.
        self.capacity = seq_len - 1 - draft_len
        self.start = first_window(len(self.context), self.capacity)
        self._pending: tuple[list[int], torch.Tensor] | None = None

    @property
    def done(self) -> bool:
        return self.produced >= self.n_bytes

    def next_draft(self) -> list[int]:
        """The next D bytes drafted after the context (none past the bytes still wanted)."""
        drafted = min(self.draft_len, self.n_bytes - self.produced - 1)
        draft, laws = self.drafter.draft(self.context, drafted, self.generator)
        self._pending = (draft, laws)
        return draft

    def sweep_input(
        self, draft: list[int], d_model: int, sigma_max: float
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """-> (x (1, P + D): the context's window then the draft, z (1, M * (D + 1), d) at
        sigma_max in antithetic pairs (one draw with a fork), P)."""
        self.start = window_start(len(self.context), self.start, self.capacity)
        context = self.context[self.start :]
        copies = 1 if self.fork else self.draws
        shape = (len(draft) + 1, d_model)
        noise = antithetic_normal(copies, shape, self.generator)
        x = torch.tensor([context + draft], dtype=torch.long)
        return x, sigma_max * noise.reshape(1, -1, d_model), len(context)

    def push(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, M * (D + 1), 256) -> the emitted bytes (1, m), 1 <= m <= D + 1."""
        assert self._pending is not None, "push follows next_draft"
        draft, laws = self._pending
        self._pending = None
        per_draw = logits.cpu().reshape(-1, len(draft) + 1, logits.shape[-1])  # (M, D + 1, 256)
        if self.sampling.utf8:  # each position's law given the context and the draft before it
            states = utf8.states_along(utf8.state_after(self.context), draft)
            per_draw = utf8.mask_logits(per_draw, torch.tensor(states).expand(per_draw.shape[:2]))
        probs = sampling_probs(per_draw, self.sampling).mean(dim=0)  # p_bar (D + 1, 256)
        new = accept_draft(draft, laws, probs, self.generator)[: self.n_bytes - self.produced]
        self.traversals += 1
        self.drafted += len(draft)
        self.context += new
        self.produced += len(new)
        return torch.tensor([new], dtype=torch.long)


@torch.no_grad()
def generate_speculative(
    denoise: Denoiser,
    prompt: torch.Tensor,
    n_bytes: int,
    *,
    drafter: Drafter,
    draft_len: int,
    grid: list[tuple[int, float]],
    targets: torch.Tensor,
    seq_len: int,
    sampling: Sampling,
    generator: torch.Generator,
    method: str = "euler",
    draws: int = DEFAULT_VERIFY_DRAWS,
) -> tuple[torch.Tensor, SpeculativeLoop]:
    """prompt (1, Lp) continued by n_bytes with a K = 1 stack -> ((1, n_bytes), the loop)."""
    loop = SpeculativeLoop(
        prompt,
        n_bytes,
        drafter=drafter,
        draft_len=draft_len,
        seq_len=seq_len,
        sampling=sampling,
        generator=generator,
        draws=draws,
        fork=verify_fork(len(grid), method, draws),
    )

    def verify(draft: list[int]) -> torch.Tensor:
        x, z, context_len = loop.sweep_input(draft, targets.shape[1], grid[0][1])
        device = targets.device
        layout, fork = verify_sweep_layout(context_len, len(draft), loop.draws, loop.fork, device)
        return one_sweep(
            denoise,
            x.to(device),
            z.to(device),
            grid,
            targets,
            layout,
            method=method,
            generator=generator,
            fork=fork,
        )

    return _drive(loop, verify), loop


@torch.no_grad()
def generate_autoregressive_speculative(
    model: Callable[[torch.Tensor], torch.Tensor],
    prompt: torch.Tensor,
    n_bytes: int,
    *,
    drafter: Drafter,
    draft_len: int,
    seq_len: int,
    sampling: Sampling,
    generator: torch.Generator,
) -> tuple[torch.Tensor, SpeculativeLoop]:
    """The same with an autoregressive verifier `model(x (1, L)) -> logits (1, L, 256)`."""
    loop = SpeculativeLoop(
        prompt,
        n_bytes,
        drafter=drafter,
        draft_len=draft_len,
        seq_len=seq_len,
        sampling=sampling,
        generator=generator,
    )

    def verify(draft: list[int]) -> torch.Tensor:
        x = loop.context[-(seq_len - len(draft)) :] + draft
        return model(torch.tensor([x], device=prompt.device))[:, -(len(draft) + 1) :]

    return _drive(loop, verify), loop


def _drive(loop: SpeculativeLoop, verify: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
    """Run `loop` in this process -> the emitted bytes (1, n)."""
    out = []
    while not loop.done:
        draft = loop.next_draft()
        out.append(loop.push(verify(draft)))
    return torch.cat(out, dim=1)
