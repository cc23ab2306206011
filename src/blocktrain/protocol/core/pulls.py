"""Compressed pulls (docs/protocol.md, Compressed pulls): a version sent as a delta from the
weights a worker already holds, its *view* (named by `view_id`, a SHA-256 of its tensors).

With `exact_pulls` off, the worker asks `GET .../versions/{v}/delta?base=VIEW&wire=CODEC` and
gets compress(W_v - view): each delta is taken against the view, so what one left out is in the
next (error feedback in the construction). Both sides compute the new view with the same
elementwise operations and agree bit for bit; on a mismatch, or a base no longer held
(`unknown_base`), the worker pulls whole.

Exact pulls (the default) commit every version as the pull codec carries it (`commit_step`,
the remainder waiting at the aggregator, as in DoubleSqueeze): the delta of version v is that
commit's body (`Commits`), the same for every worker, and views are fp32. A URL names all its
answer depends on, so it is as immutable and cacheable as the version."""

from __future__ import annotations

import functools
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
    """A block's weights as one worker holds them: in the wire dtype, or widened to fp32 under
    exact pulls (`as_held`)."""

    block: int
    version: int
    tensors: Tensors

    @functools.cached_property
    def id(self) -> str:
        """`view_id` of the tensors, computed when first asked: a delta from the view names it,
        a commit (exact pulls) does not."""
        return view_id(self.tensors)


def as_held(tensors: Tensors, exact: bool) -> Tensors:
    """Tensors pulled whole (in the wire dtype) as a worker holds them: widened to fp32 under
    exact pulls, so that no later step is rounded away."""
    return {k: v.float() for k, v in tensors.items()} if exact else tensors


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


def _parts(decoded: tensorwire.Decoded, base: View, codec: DeltaWire) -> Tensors:
    """A delta body's parts decoded against `base`, through the checks a push goes through;
    ProtocolError when they fail."""
    spec = BlockSpec({k: tuple(v.shape) for k, v in base.tensors.items()}, delta_wire=str(codec))
    c = Candidate(base.block, decoded, spec, Limits(math.inf, 1))
    verdict = validate(
        c, (check_wire, check_names, check_shapes, check_dtypes, check_decode, check_finite)
    )
    if not verdict.accepted:
        raise ProtocolError(f"bad delta ({verdict.reason}): {verdict.detail}")
    return c.tensors


def _read(body: bytes) -> tensorwire.Decoded:
    try:
        return tensorwire.decode(body)
    except WireError as exc:
        raise ProtocolError(f"unreadable delta: {exc.detail}") from exc


def read_delta(body: bytes, base: View, version: int, codec: DeltaWire) -> View:
    """The view a delta body leads to from `base`. ProtocolError when the body is not a delta of
    this block and version from this base in this codec, or when the result is not the view the
    aggregator says it is (then the worker pulls the whole version)."""
    decoded = _read(body)
    md = decoded.metadata
    said = (md.get("block"), md.get("version"), md.get("base"))
    if said != (str(base.block), str(version), base.id):
        raise ProtocolError(
            f"the delta is block {said[0]} version {said[1]} from view {said[2]}, not block "
            f"{base.block} version {version} from {base.id}"
        )
    out = View(base.block, version, apply(base.tensors, _parts(decoded, base, codec)))
    if out.id != md.get("view"):
        raise ProtocolError(f"the delta led to view {out.id}, not {md.get('view')}")
    return out


def read_commit(body: bytes, base: View, version: int, codec: DeltaWire) -> View:
    """Exact pulls: the view a commit body leads to from `base`, a view of the version before.
    ProtocolError when the body is not the commit of this block and version in this codec."""
    if base.version != version - 1:
        raise ProtocolError(
            f"commit {version} applies to version {version - 1}, not {base.version}"
        )
    decoded = _read(body)
    md = decoded.metadata
    said = (md.get("block"), md.get("version"), md.get("base_version"))
    if said != (str(base.block), str(version), str(version - 1)):
        raise ProtocolError(
            f"the commit is block {said[0]} version {said[1]} from version {said[2]}, not "
            f"block {base.block} version {version} from {version - 1}"
        )
    return View(base.block, version, apply(base.tensors, _parts(decoded, base, codec)))


def whole_view(block: int, version: int, weights: Tensors, dtype: str, exact: bool) -> View:
    """The view of a version pulled whole: its weights in the wire dtype, widened to fp32 under
    exact pulls (so that no later step is rounded away)."""
    sent = {k: v.to(wire_dtype(dtype)) for k, v in weights.items()}
    return View(block, version, as_held(sent, exact))


@dataclass(frozen=True)
class DeltaBody:
    body: bytes
    etag: str
    """A strong entity tag: the body's SHA-256, quoted."""
    view: View | None = None
    """The view the delta leads to (a delta from a view; none for a commit, whose result
    depends on the view it is applied to)."""


def _tagged(body: bytes) -> str:
    return f'"{hashlib.sha256(body).hexdigest()}"'


class Commits:
    """The aggregator's side under exact pulls: the last KEEP_COMMITS commits of each block, each
    encoded once (`__metadata__` block, version, base_version, delta_wire): the same body for every
    worker, as cacheable as a version."""

    def __init__(self, codec: DeltaWire, keep: int = KEEP_COMMITS) -> None:
        self.codec = codec
        self.keep = keep
        self._bodies: dict[int, OrderedDict[int, DeltaBody]] = {}
        self._lock = threading.Lock()

    def add(self, block: int, version: int, parts: Tensors) -> None:
        """Remember the step that made `version` (`commit_step`'s parts)."""
        meta = {"block": str(block), "version": str(version), "base_version": str(version - 1)}
        body = tensorwire.encode(parts, {**meta, "delta_wire": self.codec.tag})
        with self._lock:
            bodies = self._bodies.setdefault(block, OrderedDict())
            bodies[version] = DeltaBody(body, _tagged(body))
            while len(bodies) > self.keep:
                bodies.popitem(last=False)

    def get(self, block: int, version: int) -> DeltaBody:
        """The commit of `version`; Refused version_gone when it is not held (older than the
        last KEEP_COMMITS, or made before a restart)."""
        with self._lock:
            found = self._bodies.get(block, OrderedDict()).get(version)
        if found is None:
            raise refused(
                "version_gone",
                f"the commit of block {block} version {version} is not held (the aggregator "
                f"keeps the last {self.keep} in memory); pull the version whole",
            )
        return found

    def holds(self, block: int, first: int, last: int) -> bool:
        """Whether the commits of versions first..last of `block` are all held."""
        with self._lock:
            bodies = self._bodies.get(block, OrderedDict())
            return all(v in bodies for v in range(first, last + 1))


class Views:
    """The aggregator's side without exact pulls: the views it sent, by block and id, and the
    deltas from them."""

    def __init__(self, dtype: str, keep: int = KEEP_VIEWS, keep_deltas: int = KEEP_DELTAS):
        self.dtype = dtype
        self.keep = keep
        self.keep_deltas = keep_deltas
        self._views: dict[int, OrderedDict[str, View]] = {}
        self._deltas: OrderedDict[tuple[int, int, str, str], DeltaBody] = OrderedDict()
        self._lock = threading.Lock()

    def whole(self, block: int, version: int, weights: Tensors) -> View:
        """The view of a version sent whole (its weights in the wire dtype), remembered."""
        view = whole_view(block, version, weights, self.dtype, exact=False)
        self._remember(view)
        return view

    def delta(
        self, block: int, version: int, weights: Tensors, base: str, codec: DeltaWire
    ) -> DeltaBody:
        """Version `version` (`weights`, fp32) as a delta from view `base`; Refused
        unknown_base when the block holds no such view (the worker pulls it whole)."""
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
                found = self._encode(held, version, weights, codec)
                self._deltas[key] = found
                while len(self._deltas) > self.keep_deltas:
                    self._deltas.popitem(last=False)
        assert found.view is not None
        self._remember(found.view)  # its holders may ask for a delta from it next
        return found

    def _encode(self, base: View, version: int, weights: Tensors, codec: DeltaWire) -> DeltaBody:
        diff = {k: weights[k].float() - v.float() for k, v in base.tensors.items()}
        parts = codecs.compress(diff, codec).parts
        meta = {"block": str(base.block), "version": str(version), "base": base.id}
        meta["delta_wire"] = codec.tag
        # The result is computed from the body as the worker will read it, then named in it.
        sent = as_read(parts, {k: tuple(v.shape) for k, v in base.tensors.items()}, codec)
        view = View(base.block, version, apply(base.tensors, sent))
        body = tensorwire.encode(parts, {**meta, "view": view.id})
        return DeltaBody(body, _tagged(body), view)

    def _remember(self, view: View) -> None:
        with self._lock:
            views = self._views.setdefault(view.block, OrderedDict())
            views[view.id] = view
            views.move_to_end(view.id)
            while len(views) > self.keep:
                views.popitem(last=False)
