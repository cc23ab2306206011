"""Model FLOPs counted as the code runs, and the matmul shapes a step executes.

`count_flops(fn)` runs `fn` under a dispatch mode that records every matrix product (mm, addmm,
bmm, baddbmm, linear layers through them) and scaled-dot-product attention, with its shapes.
Training FLOPs are the usual 3 x forward (the backward pass costs twice the forward); attention
is counted dense over the query-key pairs it is given, the PaLM / nanoGPT convention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_ATTENTION_OPS = {
    op
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if (op := getattr(getattr(aten, name, None), "default", None)) is not None
}


@dataclass(frozen=True)
class MatmulShape:
    """One matrix product: (batch, m, k) @ (k, n), with whether each operand was transposed in
    memory (which changes the kernel's speed)."""

    batch: int
    m: int
    k: int
    n: int
    a_transposed: bool
    b_transposed: bool

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


@dataclass
class FlopCount:
    matmul_flops: int = 0
    attention_flops: int = 0
    matmuls: list[MatmulShape] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.matmul_flops + self.attention_flops


def _is_transposed(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and t.stride(-1) != 1 and t.stride(-2) == 1


class _Counter(TorchDispatchMode):
    def __init__(self, count: FlopCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _MATMUL_OPS:
            a, b = (
                (args[1], args[2])
                if func in (aten.addmm.default, aten.baddbmm.default)
                else (args[0], args[1])
            )
            batch = a.shape[0] if a.dim() == 3 else 1
            shape = MatmulShape(
                batch, a.shape[-2], a.shape[-1], b.shape[-1], _is_transposed(a), _is_transposed(b)
            )
            self.count.matmuls.append(shape)
            self.count.matmul_flops += shape.flops
        elif func in _ATTENTION_OPS:
            q, k = args[0], args[1]  # (N, H, Lq, hd), (N, H, Lk, hd)
            n_heads = math.prod(q.shape[:-2])
            # QK^T and the weighted sum of V: 2 products of Lq x hd x Lk each
            self.count.attention_flops += 4 * n_heads * q.shape[-2] * k.shape[-2] * q.shape[-1]
        return func(*args, **kwargs)


def count_flops(fn: Callable[[], Any]) -> FlopCount:
    """Run `fn` once and count the FLOPs of its matrix products and attention."""
    count = FlopCount()
    with _Counter(count):
        fn()
    return count
