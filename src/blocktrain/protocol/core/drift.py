"""Patient attackers (docs/protocol.md, Aggregation, "Drift"): an identity whose accepted votes
pass every check of their round but lean, round after round, the same way.

At each commit of a round of at least MIN_VOTES votes, each vote's residual is read against the
coordinate median of the votes that helped most (`reference`): with leaning identities the
majority of a block, the median of all the others is the lean itself (bench/adversarial.py,
drift_four). Per identity and block a count sketch, its buckets drawn from a secret seed, keeps
the decayed sum of the residuals and their energy; its score (whole-residual consistency, or its
most persistent bucket) is about 1 for independent noise and grows like sqrt(t) for a constant
direction. Past `DriftTracker.bar` the identity is flagged: its reputation halved, its updates
to the block refused `drift` for `drift_min_rounds` rounds. An identity whose probe effects fell
further than those it was read against is spared. Sketches and flags live in memory."""

from __future__ import annotations

import hashlib
import math
import secrets
import statistics
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.core.verdict import Verdict

Tensors = dict[str, torch.Tensor]

DRIFT_BUCKETS = 16384
"""k: 64 KiB of fp32 per identity and block, whatever the block's size."""
DRIFT_DECAY = 0.95
"""Per observed vote: the score describes about the last 40 (a constant direction saturates at
consistency sqrt((1 + 0.95) / (1 - 0.95)) = 6.2), and an honest identity's slow, bounded
persistence does not add up over a long run."""
DRIFT_FORGET = 64
"""Rounds of its block without a vote after which an identity's sketch is dropped."""
MIN_VOTES = 4
MIN_REFERENCE = 3
"""The fewest votes a residual is read against (`reference`): the median of 3 holds against one
leaning vote among them."""


@dataclass
class Sketch:
    """One identity's recent residuals on one block."""

    sums: torch.Tensor
    """S, (k,) fp32: the decayed sum of the sketched residuals."""
    energy: float = 0.0
    votes: int = 0
    last: int = 0
    """The block's round of the last vote observed."""
    effect: float = 0.0
    """The decayed sum of its votes' probe effects (relative loss changes: negative helps)..."""
    peers: float = 0.0
    """... and of the median effect of the other votes its residuals were read against."""

    def helped_more(self) -> bool:
        """Whether its votes lowered the held-out loss more than those it was read against."""
        return self.effect < self.peers

    def score(self) -> float:
        if not self.energy > 0:
            return 0.0
        k = self.sums.numel()
        consistency = float(self.sums.norm()) / math.sqrt(self.energy)
        peak = float(self.sums.abs().max()) / math.sqrt(self.energy / k)
        return max(consistency, peak / math.sqrt(2 * math.log(2 * k)))


@dataclass(frozen=True)
class Drifted:
    """An identity flagged at a commit."""

    identity: Hashable
    block: int
    score: float
    votes: int
    until: int
    """The last round of the block its updates are refused in."""


def residuals(votes: Sequence[Tensors], reference: Sequence[int] | None = None) -> list[Tensors]:
    """v_i - the coordinate median of the other votes of `reference` (indices; None: all), the
    mean of the middle two when they are even in number, each flattened; `reference` holds at
    least 2 votes (`observe` asks for MIN_VOTES and MIN_REFERENCE). `residual_pieces`, whole."""
    out: list[Tensors] = [{name: torch.empty(t.numel()) for name, t in v.items()} for v in votes]
    for name, at, pieces in residual_pieces(votes, reference):
        for whole, piece in zip(out, pieces, strict=True):
            whole[name][at] = piece
    return out


SELECT_VALUES = 1 << 21
"""Votes x coordinates of one tensor read at a time: 8 MB of fp32 per intermediate, not the
votes x the block (333 votes of 1M, a 1,000-worker round on 3 blocks: 1.3 GB), and a few times
faster than 87 MB pieces, which overflow the caches (bench/commit_cost.py)."""


def residual_pieces(
    votes: Sequence[Tensors], reference: Sequence[int] | None = None
) -> Iterator[tuple[str, slice, torch.Tensor]]:
    """(tensor name, coordinates, the votes' residuals there as one (votes, coordinates) fp32
    tensor), SELECT_VALUES // votes coordinates of one tensor at a time. The ranks a median
    reads come from two introselects along each coordinate's votes (`_middle_ranks`), with the
    values a full sort gives (a selection returns the votes' own). The j-th smallest of the
    others, one vote of the reference left out, is the j-th of all of them when the vote lies
    above it, else the (j+1)-th (ties hold equal values either way)."""
    n = len(votes)
    ref = list(range(n)) if reference is None else sorted(reference)
    m = len(ref)
    lo, hi = max(0, (m - 1) // 2 - 1), min(m, m // 2 + 2)  # the ranks a median reads
    columns = max(1, SELECT_VALUES // n)
    for name in votes[0]:
        flat = [v[name].flatten() for v in votes]
        for s in range(0, flat[0].numel(), columns):
            at = slice(s, s + columns)
            piece = torch.stack([f[at] for f in flat]).float()  # (n, coordinates)
            inside = piece if m == n else piece[ref]
            rows = inside.t().contiguous()  # (coordinates, m): each coordinate's votes
            picked = dict(zip(range(lo, hi), _middle_ranks(rows, lo, hi), strict=True))
            if m == n:
                yield name, at, piece - _median(picked, m, piece)
                continue
            out = piece - _median(picked, m, None)
            out[ref] = inside - _median(picked, m, inside)
            yield name, at, out


def _middle_ranks(rows: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
    """The lo-th .. (hi-1)-th smallest of each row of `rows` (coordinates, m), each (coordinates,).
    numpy's introselect for one rank, then for the few next ones in the rest, then a sort of
    those few: 5x faster than torch's topk, and one partition for several ranks at once is 5x
    slower than for one (bench/commit_cost.py: a 100-vote commit of 1M, 2.97 s -> 1.29 s)."""
    a = rows.numpy()
    first = np.partition(a, lo, axis=1)
    out = [torch.from_numpy(np.ascontiguousarray(first[:, lo]))]
    if hi - lo > 1:
        rest = np.partition(first[:, lo + 1 :], hi - lo - 2, axis=1)[:, : hi - lo - 1]
        rest.sort(axis=1)
        out += [torch.from_numpy(np.ascontiguousarray(rest[:, j])) for j in range(hi - lo - 1)]
    return out


def _median(picked: dict[int, torch.Tensor], m: int, left_out: torch.Tensor | None) -> torch.Tensor:
    """The coordinate median of the m votes (`picked`: the j-th smallest, for the ranks around
    the middle), less each vote of `left_out` (votes, coordinates) in turn (None: of all)."""
    if left_out is not None:
        m -= 1

    def nth(j: int) -> torch.Tensor:
        if left_out is None:
            return picked[j]
        return _select(left_out > picked[j], picked[j], picked[j + 1])

    return nth(m // 2) if m % 2 else (nth(m // 2 - 1) + nth(m // 2)) / 2


def _select(cond: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.where(cond, a, b) for fp32 a and b, bit for bit, on their bits: torch's CPU `where`
    is not vectorised (3.6 ns a value against 1.4 here, (333, 8192) votes)."""
    mask = cond.to(torch.int32).neg_()  # all ones where cond
    a, b = a.view(torch.int32), b.view(torch.int32)
    return (b ^ ((a ^ b) & mask)).view(torch.float32)


def reference(effects: Sequence[float]) -> list[int]:
    """The votes residuals are read against: the max(MIN_REFERENCE, ceil(n / 2)) whose probe
    effects lowered the held-out loss the most (docs/protocol.md, Drift, says why); among
    honest votes, any half holds the consensus."""
    n = len(effects)
    m = max(MIN_REFERENCE, math.ceil(n / 2))
    return sorted(range(n), key=lambda i: effects[i])[:m]


class DriftTracker:
    """The sketches of every identity on every block, and the identities refused for drift.
    `threshold` 0 turns it off; `seed`: the buckets and signs (None: a secret drawn here)."""

    def __init__(self, threshold: float, min_rounds: int, seed: int | None = None) -> None:
        self.threshold = threshold
        self.min_rounds = min_rounds
        self.seed = secrets.randbits(62) if seed is None else seed
        self.sketches: dict[tuple[int, Hashable], Sketch] = {}
        self.refused: dict[tuple[int, Hashable], Drifted] = {}

    @property
    def on(self) -> bool:
        return self.threshold > 0

    def _buckets(
        self, block: int, vote: Tensors, k: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per tensor, each coordinate's bucket and sign, drawn from the seed and the tensor's
        place in name order (once per commit: they are not kept, so the block's size costs no
        memory here)."""
        out = {}
        for t, name in enumerate(sorted(vote)):
            key = hashlib.blake2b(f"{self.seed}:{block}:{t}".encode(), digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(key) >> 1)
            n = vote[name].numel()
            bucket = torch.randint(k, (n,), generator=gen)
            out[name] = bucket, torch.randint(2, (n,), generator=gen).float().mul_(2).sub_(1)
        return out

    def observe(
        self,
        block: int,
        round: int,
        identities: Sequence[Hashable],
        votes: Sequence[Tensors],
        effects: Sequence[float | None] | None = None,
    ) -> list[Drifted]:
        """Feed one committed round's votes (one per identity) and their probe effects (None:
        not probed); the identities it flags."""
        if not self.on:
            return []
        for key in [
            k for k, s in self.sketches.items() if k[0] == block and round - s.last > DRIFT_FORGET
        ]:
            del self.sketches[key]
        for key in [k for k, d in self.refused.items() if k[0] == block and round > d.until]:
            del self.refused[key]
        if len(votes) < MIN_VOTES:
            return []
        k = min(DRIFT_BUCKETS, sum(t.numel() for t in votes[0].values()))
        buckets = self._buckets(block, votes[0], k)
        known = [e for e in effects or () if e is not None]
        probed = len(known) == len(votes)
        ref = reference(known) if probed else list(range(len(votes)))
        sketches = [self.sketches.get((block, who)) or Sketch(torch.zeros(k)) for who in identities]
        sums = torch.stack([sketch.sums for sketch in sketches]).mul_(DRIFT_DECAY)  # (votes, k)
        energy = torch.zeros(len(votes), dtype=torch.float64)
        for name, at, pieces in residual_pieces(votes, ref):  # no vote's whole residual is held
            bucket, sign = buckets[name]
            sums.index_add_(1, bucket[at], pieces * sign[at])
            energy += pieces.pow(2).sum(1)
        flagged = []
        for i, (identity, sketch) in enumerate(zip(identities, sketches, strict=True)):
            key = (block, identity)
            sketch.sums = sums[i].clone()
            sketch.energy = DRIFT_DECAY**2 * sketch.energy + float(energy[i])
            sketch.votes, sketch.last = sketch.votes + 1, round
            sketch.effect *= DRIFT_DECAY
            sketch.peers *= DRIFT_DECAY
            if probed:
                sketch.effect += known[i]
                sketch.peers += statistics.median(known[j] for j in ref if j != i)
            self.sketches[key] = sketch
            score = sketch.score()
            if score > self.bar(sketch.votes):
                if sketch.helped_more():
                    continue  # the others lean, not this identity
                drifted = Drifted(identity, block, score, sketch.votes, round + self.min_rounds)
                self.refused[key] = drifted
                del self.sketches[key]
                flagged.append(drifted)
        return flagged

    def bar(self, votes: int) -> float:
        """The score that flags after `votes` observed votes: the threshold from min_rounds on, and
        threshold x sqrt(min_rounds / votes) before: a constant lean's score grows like sqrt(votes), so
        a bolder one is flagged sooner (drift_four: 28 at the first vote, bar 15.8), and the bar never
        falls below the threshold no honest identity reached."""
        return self.threshold * math.sqrt(max(1.0, self.min_rounds / votes))

    def standing(self, block: int, identity: Hashable, open_round: int) -> Verdict:
        """Refused `drift` while flagged on this block."""
        drifted = self.refused.get((block, identity))  # only read: `observe` prunes, on a
        if drifted is None or open_round > drifted.until:  # thread of its own in the service
            return Verdict.ok()
        return Verdict.refuse(
            "drift",
            f"this identity's last {drifted.votes} accepted votes on block {block} leaned one "
            f"way against the others' (drift score {drifted.score:.2f} > {self.threshold:g}); "
            f"its updates are refused until round {drifted.until} closes",
        )

    def score(self, block: int, identity: Hashable) -> float | None:
        """The identity's drift score on the block (None: not observed since its last flag)."""
        sketch = self.sketches.get((block, identity))
        return None if sketch is None else sketch.score()


def tracker(settings: AggregatorSettings, seed: int | None = None) -> DriftTracker:
    """The settings' tracker; off for a selecting push codec (topk, sparse), whose votes are
    each mostly zeros where the others' are not: their residuals are the worker's own selection,
    which error feedback keeps on the same coordinates (honest, and consistent)."""
    selects = DeltaWire.parse(settings.push_wire).selects
    threshold = 0.0 if selects else settings.drift_threshold
    return DriftTracker(threshold, settings.drift_min_rounds, seed)
