"""What a lossy push codec sends and what it keeps back, per tensor kind and per push: two of
issue 56's measures of why sparse deltas lose at the small shape (the density each kind of
tensor gets, and the error-feedback residual's norm over rounds).

`traced()` wraps `DeltaEncoder.compress` for the length of one run (every row of
`bench/compression.py`, its `codec_trace`): every push of every worker is summed, per push index (the worker's n-th push, a
round under lockstep) and per tensor kind, into squared norms of the delta trained, of what
the push sent and of the residual kept. `Trace.summary()` reads them as

    sent_share       |sent|^2 / |delta + beta x residual before|^2: how much of what the
                     worker meant to send went out (1 for a dense codec);
    residual_ratio   |residual after| / |delta|: the kept residual against one push's delta
                     (above 1: more than a round of training waits; 0 for a dense codec);

pooled over the workers (squared norms summed before the ratio).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from blocktrain.protocol.core.codecs import DeltaEncoder

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("embeddings", (".embed.", ".z_in.")),
    ("noise conditioning", (".noise_mlp.", ".modulation.", ".final_mod.")),
    ("attention", (".qkv.", ".proj.")),
    ("mlp", (".fc1.", ".fc2.")),
    ("norms", (".ln1.", ".ln2.", ".aux_norm.")),
    ("heads", (".out_proj.", ".head.", ".aux_head.")),
)
"""Tensor kinds of a block (model/block.py), by a part of the parameter's dotted name; the
first kind that matches wins, and a name none matches is `other`."""


def kind_of(name: str) -> str:
    dotted = f".{name}."
    for kind, parts in KINDS:
        if any(part in dotted for part in parts):
            return kind
    return "other"


def _sq(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


class Trace:
    """Squared norms by (push index, kind): [delta, total, sent, residual after]."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, str], list[float]] = {}
        self._pushes: dict[int, int] = {}  # id(encoder) -> its pushes so far

    def record(
        self,
        encoder: DeltaEncoder,
        delta: dict[str, torch.Tensor],
        sent: dict[str, torch.Tensor],
        residual: dict[str, torch.Tensor] | None,
    ) -> None:
        index = self._pushes.get(id(encoder), 0) + 1
        self._pushes[id(encoder)] = index
        for name, d in delta.items():
            d = d.detach().to("cpu", torch.float32)
            s = sent[name].to(torch.float32)
            r = residual[name] if residual is not None else torch.zeros_like(d)
            row = self.sums.setdefault((index, kind_of(name)), [0.0, 0.0, 0.0, 0.0])
            row[0] += _sq(d)
            row[1] += _sq(s + r)  # what the push meant to send: delta + beta x residual before
            row[2] += _sq(s)
            row[3] += _sq(r)

    def summary(self) -> dict[str, list[list[float]]]:
        """kind -> [[push index, sent_share, residual_ratio], ...] in push order."""
        out: dict[str, list[list[float]]] = {}
        for (index, kind), (delta, total, sent, residual) in sorted(self.sums.items()):
            share = sent / total if total > 0 else 1.0
            ratio = (residual / delta) ** 0.5 if delta > 0 else 0.0
            out.setdefault(kind, []).append([index, share, ratio])
        return out


@contextlib.contextmanager
def traced() -> Iterator[Trace]:
    """Every `DeltaEncoder.compress` of the block, recorded into the Trace it yields."""
    trace = Trace()
    original = DeltaEncoder.compress

    def compress(self: DeltaEncoder, delta: dict[str, torch.Tensor]) -> Any:
        out = original(self, delta)
        trace.record(self, delta, out.sent, self.residual)
        return out

    DeltaEncoder.compress = compress  # type: ignore[method-assign]
    try:
        yield trace
    finally:
        DeltaEncoder.compress = original  # type: ignore[method-assign]


def markdown(rows: list[dict[str, Any]]) -> str:
    """docs/research/compression.md's table of the traced rows with a lossy codec: per tensor
    kind, the share of the update sent and the residual kept at the first, middle and last push."""
    traced_rows = [
        r for r in rows if any(e[1] < 1 for v in r.get("codec_trace", {}).values() for e in v)
    ]
    if not traced_rows:
        return ""
    lines = [
        "What each push sends and keeps back, per tensor kind (`bench/codec_trace.py`, recorded "
        "by every `bench/compression.py` row): **sent** |sent|² / |delta + residual|², the share "
        "of what the worker meant to send that went out; **kept** |residual| / |delta|, the "
        "residual's size against one push's delta (above 1: more than a round of training waits); "
        "pooled over the 6 workers, at the first, middle and last push.",
        "",
        "| preset | route | rounds x H | seed | wire | kind | sent (first / middle / last) | "
        "kept (first / middle / last) |",
        "|---|---|---|---:|---|---|---|---|",
    ]
    for r in traced_rows:
        head = (
            f"| {r.get('preset', 'tiny')} | {r.get('route', 'features')} | {r['rounds']} x "
            f"{r['local_steps']} | {r['seed']} | {r['wire']}"
            + (f" [{r['variant']}] " if r.get("variant") else " ")
        )
        for kind, entries in sorted(r["codec_trace"].items()):
            picks = [entries[0], entries[len(entries) // 2], entries[-1]]
            sent = " / ".join(f"{e[1]:.3f}" for e in picks)
            kept = " / ".join(f"{e[2]:.2f}" for e in picks)
            lines.append(f"{head}| {kind} | {sent} | {kept} |")
    return "\n".join(lines)
