"""Compressed pulls: a version sent as a delta from the weights a worker already holds.

A worker that pulled block b holds a *view* of it: the tensors exactly as they arrived, in the
wire dtype, named by `view_id` (a SHA-256 of their names, dtypes, shapes and bytes). When the
aggregator's `pull_wire` is int8, topk:RATIO or sparse:DENSITY:BITS (by default, whenever pushes are compressed), the
worker asks for the next version *from its view*:

    GET /v1/blocks/{b}/versions/{v}/delta?base=VIEW&wire=CODEC

and gets compress(W_v - view) in that codec: the same parts as a push (`codecs`), with
`__metadata__` block, version, base, view (the id of the result) and delta_wire. The new view
is `apply(view, decoded delta)`: the sum in fp32, rounded to the wire dtype. Both sides compute
it with the same elementwise operations, so they agree bit for bit; the worker checks this
against the id the aggregator sent, and on a mismatch, or a base the aggregator no longer holds
(404 `unknown_base`), it pulls the whole version instead.

Error feedback lies in the construction. Each delta is taken against the view, not against the
last version, so what one delta did not carry (int8 rounding, top-k's small coordinates) is
still in the next one: a chained view stays within one delta's error of the weights instead of
drifting.

**Exact pulls** (the setting `exact_pulls`, on by default) go further. The aggregator commits
every new version in the pull codec itself (`commit_step`): the new weights are the old plus the
step *as the codec carries it*, and what the codec left out waits in a remainder at the
aggregator, added to the next step (error feedback on the aggregator's side, as DoubleSqueeze
and SparseLoCo's all-gather of compressed updates have it). The delta of version v from a view
of version v - 1 is then that commit's body, whatever the view, and a worker holding the
weights (up to the rounding of its first, whole pull, a constant) holds them still after it:
nobody trains from a view that lags the weights. Views are then fp32 (the wire dtype's values,
widened), so that no small step is rounded away. A worker more than one version behind walks
the versions one at a time; any other base is `unknown_base` and the worker pulls whole.

The URL names everything its answer depends on: the version (never changes), the base (by its
contents) and the codec. It is therefore as immutable, and as cacheable, as the version itself.
The aggregator remembers the last few views of each block (those it sent whole or as deltas)
and commits; after a restart it holds none, and each worker pulls one whole version again.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from blocktrain import tensorwire
from blocktrain.errors import ProtocolError
from blocktrain.protocol.core import codecs
from blocktrain.protocol.core.bodies import WireError, wire_dtype
from blocktrain.protocol.core.delta_wire import DeltaWire
from blocktrain.protocol.core.validation import (
    BlockSpec,
    Candidate,
    Limits,
    check_decode,
    check_dtypes,
    check_finite,
    check_names,
    check_shapes,
    check_wire,
    validate,
)
from blocktrain.protocol.core.verdict import refused

Tensors = dict[str, torch.Tensor]

KEEP_VIEWS = 6
"""Views remembered per block: each worker's last pull, whole or chained, for a few versions."""
KEEP_DELTAS = 8
"""Encoded delta bodies kept in memory (the replicas of a block ask for the same one)."""
KEEP_COMMITS = 8
"""Commits kept per block under exact pulls: a worker at most this many versions behind walks
them; one further behind pulls whole."""


def view_id(tensors: Tensors) -> str:
    """Names the contents: SHA-256 over each tensor's name, dtype, shape and bytes (sorted)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class View:
    """A block's weights as one worker holds them, in the wire dtype."""

    block: int
    version: int
    tensors: Tensors
    id: str

    @staticmethod
    def of(block: int, version: int, tensors: Tensors) -> View:
        return View(block, version, tensors, view_id(tensors))


def apply(base: Tensors, delta: Tensors) -> Tensors:
    """The view a delta leads to: base + delta in fp32, rounded to the base's dtype."""
    return {k: (v.float() + delta[k]).to(v.dtype) for k, v in base.items()}


def as_read(parts: Tensors, shapes: dict[str, tuple[int, ...]], codec: DeltaWire) -> Tensors:
    """The dense fp32 delta that `parts` decode to once encoded and read back, as a worker
    reads them."""
    read = tensorwire.decode(tensorwire.encode(parts, {}))
    return codecs.decode(read.tensors, shapes, codec)


@dataclass(frozen=True)
class CommitStep:
    """A version committed in the pull codec (exact pulls)."""

    weights: Tensors
    """The old weights plus `parts` decoded, in fp32."""
    remainder: Tensors
    """What the codec left out, added to the next step."""
    parts: Tensors
    """The step as it travels (the codec's parts)."""


def commit_step(
    old: Tensors, new: Tensors, remainder: Tensors | None, codec: DeltaWire
) -> CommitStep:
    """The commit of `new` over `old` under exact pulls: the step new - old plus the remainder
    left by the last commit, in `codec`; the weights are `old` plus what that carries, computed
    as a worker applies a delta (`apply`), so that both sides hold the same bits."""
    step = {k: new[k].float() - v.float() for k, v in old.items()}
    if remainder is not None:
        step = {k: v + remainder[k] for k, v in step.items()}
    parts = codecs.compress(step, codec).parts
    sent = as_read(parts, {k: tuple(v.shape) for k, v in old.items()}, codec)
    return CommitStep(apply(old, sent), {k: step[k] - sent[k] for k in step}, parts)


def read_delta(body: bytes, base: View, version: int, codec: DeltaWire) -> View:
    """The view a delta body leads to from `base`. ProtocolError when the body is not a delta of
    this block and version from this base in this codec, or when the result is not the view the
    aggregator says it is (then the worker pulls the whole version)."""
    try:
        decoded = tensorwire.decode(body)
    except WireError as exc:
        raise ProtocolError(f"unreadable delta: {exc.detail}") from exc
    md = decoded.metadata
    said = (md.get("block"), md.get("version"), md.get("base"))
    if said != (str(base.block), str(version), base.id):
        raise ProtocolError(
            f"the delta is block {said[0]} version {said[1]} from view {said[2]}, not block "
            f"{base.block} version {version} from {base.id}"
        )
    spec = BlockSpec({k: tuple(v.shape) for k, v in base.tensors.items()}, delta_wire=str(codec))
    c = Candidate(base.block, decoded, spec, Limits(math.inf, 1))
    verdict = validate(
        c, (check_wire, check_names, check_shapes, check_dtypes, check_decode, check_finite)
    )
    if not verdict.accepted:
        raise ProtocolError(f"bad delta ({verdict.reason}): {verdict.detail}")
    out = View.of(base.block, version, apply(base.tensors, c.tensors))
    if out.id != md.get("view"):
        raise ProtocolError(f"the delta led to view {out.id}, not {md.get('view')}")
    return out


@dataclass(frozen=True)
class DeltaBody:
    body: bytes
    etag: str
    """A strong entity tag: the body's SHA-256, quoted."""
    view: View
    """The view the delta leads to."""


class Views:
    """The aggregator's side: the views it sent, by block and id, and the deltas from them;
    under exact pulls (`exact`) also the last commits, which are those deltas."""

    def __init__(
        self,
        dtype: str,
        keep: int = KEEP_VIEWS,
        keep_deltas: int = KEEP_DELTAS,
        exact: bool = False,
    ):
        self.dtype = wire_dtype(dtype)
        self.keep = keep
        self.keep_deltas = keep_deltas
        self.exact = exact
        self._views: dict[int, OrderedDict[str, View]] = {}
        self._deltas: OrderedDict[tuple[int, int, str, str], DeltaBody] = OrderedDict()
        self._commits: dict[int, OrderedDict[int, Tensors]] = {}
        self._lock = threading.Lock()

    def whole(self, block: int, version: int, weights: Tensors) -> View:
        """The view of a version sent whole (its weights in the wire dtype; widened to fp32
        under exact pulls), remembered."""
        view = View.of(block, version, self.held(weights))
        self._remember(view)
        return view

    def held(self, tensors: Tensors) -> Tensors:
        """Tensors as a worker holds them after a whole pull: in the wire dtype, widened to
        fp32 under exact pulls (so that the steps after it are not rounded away)."""
        out = {k: v.to(self.dtype) for k, v in tensors.items()}
        return {k: v.float() for k, v in out.items()} if self.exact else out

    def commit(self, block: int, version: int, parts: Tensors) -> None:
        """Remember the step that made `version` (exact pulls: `commit_step`'s parts)."""
        with self._lock:
            commits = self._commits.setdefault(block, OrderedDict())
            commits[version] = parts
            while len(commits) > KEEP_COMMITS:
                commits.popitem(last=False)

    def holds_commits(self, block: int, first: int, last: int) -> bool:
        """Whether the commits of versions first..last of `block` are all held."""
        with self._lock:
            commits = self._commits.get(block, OrderedDict())
            return all(v in commits for v in range(first, last + 1))

    def delta(
        self, block: int, version: int, weights: Tensors | None, base: str, codec: DeltaWire
    ) -> DeltaBody:
        """Version `version` (`weights`, fp32; not needed under exact pulls) as a delta from
        view `base`; Refused unknown_base when the block holds no such view, or under exact
        pulls when the view is not of the version before or that commit is not held (the
        worker pulls it whole)."""
        key = (block, version, base, str(codec))
        with self._lock:  # one computation per key: the others wait, then find it cached
            found = self._deltas.get(key)
            if found is not None:
                self._deltas.move_to_end(key)
            else:
                held = self._views.get(block, OrderedDict()).get(base)
                if held is None:
                    raise refused(
                        "unknown_base",
                        f"block {block} holds no view {base[:40]!r} (restarted, or too old); "
                        "pull the whole version",
                    )
                if self.exact:
                    parts = self._commits.get(block, OrderedDict()).get(version)
                    if held.version != version - 1 or parts is None:
                        raise refused(
                            "unknown_base",
                            f"exact pulls send version {version} of block {block} from a view "
                            f"of version {version - 1} only (this view is of version "
                            f"{held.version}, or that commit is no longer held); pull the "
                            "versions in turn or the whole version",
                        )
                else:
                    assert weights is not None
                    diff = {k: weights[k].float() - v.float() for k, v in held.tensors.items()}
                    parts = codecs.compress(diff, codec).parts
                found = self._encode(held, version, parts, codec)
                self._deltas[key] = found
                while len(self._deltas) > self.keep_deltas:
                    self._deltas.popitem(last=False)
        self._remember(found.view)  # its holders may ask for a delta from it next
        return found

    def _encode(self, base: View, version: int, parts: Tensors, codec: DeltaWire) -> DeltaBody:
        meta = {"block": str(base.block), "version": str(version), "base": base.id}
        meta["delta_wire"] = codec.tag
        # The result is computed from the body as the worker will read it, then named in it.
        sent = as_read(parts, {k: tuple(v.shape) for k, v in base.tensors.items()}, codec)
        view = View.of(base.block, version, apply(base.tensors, sent))
        body = tensorwire.encode(parts, {**meta, "view": view.id})
        return DeltaBody(body, f'"{hashlib.sha256(body).hexdigest()}"', view)

    def _remember(self, view: View) -> None:
        with self._lock:
            views = self._views.setdefault(view.block, OrderedDict())
            views[view.id] = view
            views.move_to_end(view.id)
            while len(views) > self.keep:
                views.popitem(last=False)
