"""A block's clean stream cached per generation, and contexts of different lengths in one
forward pass (`Block.forward_cached`): docs/serving.md, "Batching, readiness and replicas" (the
clean-stream cache, right-aligned contexts). `KVCache` is also what a reference stage keeps.

Invariants: a token's position (its rotation) is its index less its row's pad, and padding keys
are masked out of every query; the last `fresh` indices of every row are computed (the most any
row lacks: a row that lacks fewer recomputes a few cached positions, which keeps one query block
for the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    """Keys and values of the positions a stage has seen, per layer: each (N, H, P, hd);
    `length` is P."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (drop those after, e.g. rejected drafts)."""
        if length < self.length:
            for i in self.keys:
                self.keys[i] = self.keys[i][:, :, :length]
                self.values[i] = self.values[i][:, :, :length]
            self.length = length

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values())
        )


@dataclass
class CleanCache(KVCache):
    """One block's clean stream for one generation's rows, of the bytes `tokens` (N, P)."""

    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))
    out: torch.Tensor | None = None
    """(N, P, d): the clean stream's output at each position, what the next block reads under
    `route = features`; None when no block reads it."""

    def reusable(self, x: torch.Tensor) -> int:
        """How many leading positions of the context x (N, L) this cache holds: the bytes that
        x and the cache share from position 0 on, in every row (0 when the rows differ). The
        cache is trusted only as far as the bytes say, never a length a caller claims."""
        if self.tokens.shape[0] != x.shape[0]:
            return 0
        n = min(self.length, x.shape[1])
        differ = (self.tokens[:, :n] != x[:, :n].to(self.tokens.dtype)).any(dim=0)
        first = torch.nonzero(differ)
        return int(first[0]) if len(first) else n

    def nbytes(self) -> int:
        kept = [self.tokens] + ([] if self.out is None else [self.out])
        return super().nbytes() + sum(t.numel() * t.element_size() for t in kept)


def right_align(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts [(n_j, L_j, ...)] (bytes, or one vector per position) -> (x (N, L, ...) with
    each row right-aligned, zeros (byte 0) in front; pad (N,) int64: the padding indices of
    each row), L = max L_j."""
    length = max(x.shape[1] for x in xs)
    if all(x.shape[1] == length for x in xs):
        x = torch.cat(xs) if len(xs) > 1 else xs[0]
        return x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    out = xs[0].new_zeros(sum(x.shape[0] for x in xs), length, *xs[0].shape[2:])
    pads, row = [], 0
    for x in xs:
        n, own = x.shape[:2]
        out[row : row + n, length - own :] = x
        pads += [length - own] * n
        row += n
    return out, torch.tensor(pads, dtype=torch.long, device=out.device)


@dataclass
class CleanBatch:
    """One block's clean stream for a batch of right-aligned contexts of `length` indices: the
    keys/values (per layer (N, H, length - fresh, hd)) hold the indices before the last `fresh`;
    `Block.forward_cached` computes those and leaves fresh = 0, so a block's next grid point
    computes only z. `out` (N, length, d): the clean outputs, when `route = features`."""

    pad: torch.Tensor  # (N,) int64
    length: int
    fresh: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    out: torch.Tensor | None = None

    @staticmethod
    def gather(
        jobs: list[tuple[int, int, CleanCache | None]],
        fresh: int,
        *,
        layers: int,
        heads: int,
        head_dim: int,
        out_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> CleanBatch:
        """The batch of `jobs`, each (rows, context length L_j, its cache or None), in row
        order; every job's cache must hold its first L_j - fresh positions (`reusable`).
        `out_dim` d: also keep the clean outputs."""
        length = max(lj for _, lj, _ in jobs)
        pads = [length - lj for n, lj, _ in jobs for _ in range(n)]
        pad = torch.tensor(pads, dtype=torch.long, device=device)
        past = length - fresh
        out = None
        if out_dim is not None:  # padding and the fresh indices stay zero until written
            out = torch.zeros(int(pad.shape[0]), length, out_dim, dtype=dtype, device=device)
            row = 0
            for n, lj, cache in jobs:
                if lj - fresh > 0:
                    assert cache is not None and cache.out is not None, "no outputs cached"
                    out[row : row + n, length - lj : past] = cache.out[:, : lj - fresh]
                row += n
        if len(jobs) == 1:  # one generation, no padding: its cache as it is, no copy
            n, _, cache = jobs[0]
            if past == 0:
                empty = torch.zeros(n, heads, 0, head_dim, dtype=dtype, device=device)
                return CleanBatch(pad, length, fresh, [empty] * layers, [empty] * layers, out)
            assert cache is not None and cache.length >= past, "gather past the cache"
            keys = [cache.keys[i][:, :, :past] for i in range(layers)]
            values = [cache.values[i][:, :, :past] for i in range(layers)]
            return CleanBatch(pad, length, fresh, keys, values, out)
        # Padding keys are zeros (finite: a masked key still enters the matrix product).
        n_rows = int(pad.shape[0])
        shape = (n_rows, heads, past, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        row = 0
        for n, lj, cache in jobs:
            used = lj - fresh
            if used > 0:
                assert cache is not None and cache.length >= used, "gather past the cache"
                for i in range(layers):
                    keys[i][row : row + n, :, past - used :] = cache.keys[i][:, :, :used]
                    values[i][row : row + n, :, past - used :] = cache.values[i][:, :, :used]
            row += n
        return CleanBatch(pad, length, fresh, keys, values, out)

    def split(self, contexts: list[torch.Tensor]) -> list[CleanCache]:
        """After the forward pass: each job's own cache of its context (n_j, L_j), in row
        order (copies, so that no job's cache holds the batch's tensors alive)."""
        assert self.fresh == 0, "split after the forward pass"
        out, row = [], 0
        whole = len(contexts) == 1 and contexts[0].shape[1] == self.length
        for x in contexts:
            n, lj = x.shape
            rows, idx = slice(row, row + n), slice(self.length - lj, self.length)
            keys = {i: k if whole else k[rows, :, idx].clone() for i, k in enumerate(self.keys)}
            values = {i: v if whole else v[rows, :, idx].clone() for i, v in enumerate(self.values)}
            outputs = self.outputs(rows, lj) if self.out is not None else None
            out.append(CleanCache(keys, values, lj, x.clone(), outputs))
            row += n
        return out

    def outputs(self, rows: slice, length: int) -> torch.Tensor:
        """The clean outputs of `rows`, whose contexts are `length` bytes: (n, length, d), a
        copy without the padding."""
        assert self.out is not None and self.fresh == 0, "outputs after the forward pass"
        return self.out[rows, self.length - length :].clone()

    def valid(self) -> torch.Tensor:
        """(N, length) bool: the indices holding a row's bytes (not padding)."""
        return torch.arange(self.length, device=self.pad.device)[None, :] >= self.pad[:, None]

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Indices (L,) -> each row's positions there (N, L) (0 in padding)."""
        return (index[None, :] - self.pad[:, None]).clamp(min=0)

    def clean_mask(self) -> torch.Tensor:
        """(N, 1, fresh, length) additive: the last `fresh` indices attend causally to the
        indices holding their row's bytes; a padding query attends to itself only (its output
        is never read, and a query that may attend to nothing would give NaN)."""
        index = torch.arange(self.length, device=self.pad.device)
        query = index[self.length - self.fresh :]
        causal = index[None, :] <= query[:, None]  # (fresh, length)
        own = index[None, :] == query[:, None]
        return additive(((causal[None] & self.valid()[:, None, :]) | own[None])[:, None])

    def z_mask(self, layout_mask: torch.Tensor) -> torch.Tensor:
        """The layout's mask (Lz, length + Lz) with every row's padding keys masked out ->
        (N, 1, Lz, length + Lz) additive."""
        n, z_len = self.pad.shape[0], layout_mask.shape[0]
        own = torch.ones(n, z_len, dtype=torch.bool, device=self.pad.device)
        keys = torch.cat((self.valid(), own), dim=1)
        return additive((layout_mask[None] & keys[:, None, :])[:, None])


def additive(allowed: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = may attend) as the additive one SDPA adds to the scores (0 or -inf):
    made once per pass, where SDPA would convert a bool mask in every call of every layer."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))
