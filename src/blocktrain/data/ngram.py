"""A byte n-gram drafter for speculative generation: cheap enough to run on the router, between
two traversals of the block hosts, and exact about the law it drafts from (which the
acceptance rule needs).

The model is interpolated Witten-Bell over contexts of 0..order bytes (Witten and Bell 1991; the
form of Chen and Goodman 1998, eq. 13): with c(h, y) the count of byte y after context h, T(h)
the number of distinct bytes seen after h and N(h) = sum_y c(h, y),

    P(y | h) = (c(h, y) + T(h) * P(y | h')) / (N(h) + T(h)),   h' = h without its oldest byte,

down to an add-one unigram. Built from a byte array (a split's `ByteSource.read()`); no I/O.
"""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 256


class NgramDrafter:
    """Counts of every context of 1..order bytes in `data`, and the next byte after it."""

    def __init__(self, data: np.ndarray, order: int = 4) -> None:
        if not 1 <= order <= 7:
            raise ValueError(f"order = {order} must lie in 1..7 (a context is packed in 56 bits)")
        data = np.asarray(data, dtype=np.uint8)
        if len(data) <= order:
            raise ValueError(f"{len(data)} bytes are too few for an order-{order} drafter")
        self.order = order
        unigram = np.bincount(data, minlength=VOCAB).astype(np.float64) + 1.0
        self.unigram = unigram / unigram.sum()
        # tables[k][context of k bytes packed big-endian] = (next bytes, their counts)
        self.tables: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{}]
        wide = data.astype(np.uint64)
        for k in range(1, order + 1):
            key = np.zeros(len(data) - k, dtype=np.uint64)
            for j in range(k):
                key = (key << np.uint64(8)) | wide[j : len(data) - k + j]
            pairs, counts = np.unique((key << np.uint64(8)) | wide[k:], return_counts=True)
            contexts = pairs >> np.uint64(8)
            nexts = (pairs & np.uint64(0xFF)).astype(np.int64)
            starts = np.flatnonzero(np.r_[True, contexts[1:] != contexts[:-1]])
            ends = np.r_[starts[1:], len(pairs)]
            table = {}
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
                table[int(contexts[a])] = (nexts[a:b], counts[a:b].astype(np.float64))
            self.tables.append(table)

    def probs(self, context: list[int]) -> np.ndarray:
        """P(. | the last `order` bytes of context) -> (256,) float64, summing to 1."""
        p = self.unigram
        key = 0
        for k in range(1, min(self.order, len(context)) + 1):
            key |= context[-k] << (8 * (k - 1))  # the k-byte context, big-endian
            entry = self.tables[k].get(key)
            if entry is None:
                break  # a longer context containing this one was never seen either
            nexts, counts = entry
            seen = np.zeros(VOCAB)
            seen[nexts] = counts
            p = (seen + len(nexts) * p) / (counts.sum() + len(nexts))
        return p

    def draft(
        self, context: list[int], n: int, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]:
        """n bytes drawn one after another from the drafter, each given the context and the
        bytes drafted before it -> (the bytes, the laws they were drawn from (n, 256) fp32)."""
        ctx = list(context)
        out: list[int] = []
        laws = torch.empty(n, VOCAB)
        for i in range(n):
            laws[i] = torch.from_numpy(self.probs(ctx))
            byte = int(torch.multinomial(laws[i], 1, generator=generator))
            out.append(byte)
            ctx.append(byte)
        return out, laws
