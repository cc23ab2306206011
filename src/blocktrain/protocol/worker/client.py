"""The worker's HTTP client of the aggregator.

`AggregatorClient` is httpx with explicit timeouts and an injectable transport (or a whole
`httpx.Client`, e.g. a FastAPI TestClient, so that tests run client and app in one process).
Transient failures (connection errors, timeouts, 5xx) are retried with exponential backoff and
full jitter; a 429 (the token's rate limit) is retried after its Retry-After; any other 4xx is
a refusal (`errors.Refused`) and is never retried blindly (`retrying.RetryingHttp`, its base).
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from blocktrain.errors import ProtocolError, Refused
from blocktrain.protocol.core.bodies import (
    CONTENT_TYPE,
    WireError,
    decode,
    update_body,
    version_path,
)
from blocktrain.protocol.core.delta_wire import FULL, DeltaWire, pull_codec
from blocktrain.protocol.core.pulls import View, as_held, read_commit, read_delta
from blocktrain.protocol.worker.replies import Pulled as Pulled
from blocktrain.protocol.worker.replies import PushResult as PushResult
from blocktrain.protocol.worker.replies import Registration as Registration
from blocktrain.protocol.worker.replies import fp32, seconds, told_steps
from blocktrain.protocol.worker.retrying import DEFAULT_TIMEOUT, RetryingHttp, RetryPolicy
from blocktrain.relaystream import RelayStream, StreamBody

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class AggregatorClient(RetryingHttp):
    """One worker's (or an operator's) connection to the aggregator."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        transport: httpx.BaseTransport | None = None,
        client: httpx.Client | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        verify: bool | str | ssl.SSLContext = True,
        retry: RetryPolicy | None = None,
        stop: threading.Event | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        if isinstance(verify, str):  # a CA bundle to trust (e.g. a self-signed certificate)
            verify = ssl.create_default_context(cafile=verify)
        self.http = (
            client
            if client is not None
            else httpx.Client(
                base_url=self.base_url, transport=transport, timeout=timeout, verify=verify
            )
        )
        self.retry = retry or RetryPolicy()
        self.stop = stop or threading.Event()
        self._sleep = sleep
        self._clock = clock
        """Measures the retry budget; tests pass a fake one with a fake `sleep`."""
        self._rng = rng or random.Random()
        self.worker_id: int | None = None
        self.bytes_down = 0
        self.bytes_up = 0
        self._held: tuple[str, str, Tensors] | None = None
        """(URL, ETag, tensors) of the last version downloaded, revalidated when pulled again."""
        self.pull_wire = FULL
        """The registration's pull wire: with a codec, pulls are deltas from `view`."""
        self.exact_pulls = False
        """The registration's exact pulls: views are fp32, and each delta is from the version
        before (a worker further behind walks the versions)."""
        self.view: View | None = None
        """The weights last pulled, as they arrived (the wire dtype, widened to fp32 under exact
        pulls; a worker's folder keeps it)."""
        self._latest: dict[int, tuple[int, Tensors]] = {}
        """Per other block read with `latest`: (version, tensors); a version never changes."""
        self._upstream_views: dict[int, View] = {}
        """With a pull codec, per other block read with `latest`: the view held of it (the next
        read is a delta from it, as pulls of the worker's own block are)."""
        self._elsewhere: dict[int, AggregatorClient] = {}
        """Per block read with `latest` that another aggregator serves: a client of it (no
        worker id: this worker is registered here only)."""

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ calls

    def register(
        self, block: int | None = None, name: str | None = None, resume: int | None = None
    ) -> Registration:
        """A new worker; with `resume`, this token's worker of that id taken back."""
        body: dict[str, Any] = {"block": block, "name": name, "resume_worker_id": resume}
        body = {k: v for k, v in body.items() if v is not None}
        self.worker_id = None
        doc = self._json("POST", "/v1/workers", json=body)
        self.worker_id = int(doc["worker_id"])
        self.pull_wire = str(doc.get("pull_wire") or FULL)
        self.exact_pulls = bool(doc.get("exact_pulls", False))
        return Registration(
            self.worker_id,
            int(doc["block"]),
            int(doc["data_seed"]),
            int(doc["local_steps"]),
            str(doc["wire_dtype"]),
            str(doc.get("delta_wire") or doc["wire_dtype"]),
            self.pull_wire,
            self.exact_pulls,
        )

    def leave(self) -> None:
        if self.worker_id is not None:
            self._json("DELETE", f"/v1/workers/{self.worker_id}")

    def config(self) -> dict[str, Any]:
        return self._json("GET", "/v1/config")

    def directory(self) -> dict[str, Any]:
        """Where each block's aggregator lives (`protocol.service.placement`)."""
        return self._json("GET", "/v1/directory")

    def move_to(self, url: str) -> None:
        """Talk to another aggregator of the run from now on (register there next)."""
        self.base_url = url.rstrip("/")
        self.worker_id = None
        self._held = None
        self.view = None
        self._latest = {}
        self._upstream_views = {}

    def status(self) -> dict[str, Any]:
        return self._json("GET", "/v1/status")

    def round(self, block: int, *, after: int = -1, wait: float = 0.0) -> dict[str, Any]:
        return self._json("GET", f"/v1/blocks/{block}/round", params={"after": after, "wait": wait})

    def pull(self, block: int) -> Pulled:
        """The open round's weights. The aggregator records the pull and answers 303 with the
        round in its headers (`?redirect=1`); the bytes come from the version's immutable URL,
        which a plain HTTP cache or CDN may serve, and a version already held is revalidated
        (If-None-Match, 304) instead of downloaded again. With a `pull_wire` codec the next
        version comes as a delta from the view held (`protocol.core.pulls`). An aggregator without
        versioned URLs answers with the body at once, as before."""
        response = self.request(
            "GET", f"/v1/blocks/{block}", params={"redirect": 1}, follow_redirects=False
        )
        self.bytes_down += len(response.content)
        if response.status_code >= 400:
            raise self._refusal(response)
        h = response.headers
        if response.status_code == 303:
            version = int(h["X-Version"])
            tensors, nbytes, self.view = self._version(h["Location"], block, version, self.view)
            return Pulled(
                tensors,
                block,
                version,
                int(h["X-Round"]),
                seconds(h),
                nbytes + len(response.content),
                told_steps(h),
            )
        meta, tensors = self._weights(response.content)
        tensors = fp32(tensors)
        if "round" not in meta:  # something between us followed the 303 for us
            raise ProtocolError(f"GET /v1/blocks/{block} answered a body without its round")
        return Pulled(
            tensors,
            int(meta["block"]),
            int(meta["version"]),
            int(meta["round"]),
            seconds(h),
            len(response.content),
            told_steps(h),
        )

    def latest(self, block: int) -> Tensors:
        """The latest committed version of another block (fp32), read without a pull: what a
        worker under `route = features` reads of the blocks before its own. Fetched from the
        version's immutable URL, and not again while the version stands. A block served by
        another aggregator (one aggregator per block) is read there, with the same token, at the
        URL the directory gives. With a pull codec, every version after the first comes as a
        delta from the view held of the block, as the worker's own pulls do."""
        if block in self._elsewhere:
            return self._latest_elsewhere(block)
        try:
            version = int(self.round(block)["version"])
        except Refused as exc:
            if exc.reason != "wrong_aggregator":
                raise
            return self._latest_elsewhere(block)
        url = version_path(block, version)
        if pull_codec(self.pull_wire) is not None:
            tensors, _, view = self._version(url, block, version, self._upstream_views.get(block))
            assert view is not None  # a pull codec always leaves a view
            self._upstream_views[block] = view
            return tensors
        held = self._latest.get(block)
        if held is not None and held[0] == version:
            return fp32(held[1])
        response = self.request("GET", url, follow_redirects=True)
        self.bytes_down += len(response.content)
        if response.status_code >= 400:
            raise self._refusal(response)
        tensors = self._version_body(response.content, url, block, version)
        self._latest[block] = (version, tensors)
        return fp32(tensors)

    def _latest_elsewhere(self, block: int) -> Tensors:
        """`latest(block)` from the aggregator that serves the block, found in the directory
        once and again after it answers that the block moved."""
        return self._elsewhere_call(block, lambda peer: peer.latest(block))

    def _elsewhere_call(self, block: int, call: Callable[[AggregatorClient], Any]) -> Any:
        """`call` on a client of the aggregator that serves `block` (found in the directory
        once, and again after it answers that the block moved), its bytes counted here."""
        peer = self._elsewhere.get(block)
        if peer is None:
            url = str(self.directory().get("blocks", {}).get(str(block)) or "").rstrip("/")
            if not url or url == self.base_url:
                raise ProtocolError(
                    f"the directory of {self.base_url} names no aggregator of block {block}"
                )
            peer = self._elsewhere[block] = AggregatorClient(
                url,
                self.token,
                client=self.http,  # the same connection settings; requests name the peer's URL
                retry=self.retry,
                stop=self.stop,
                sleep=self._sleep,
                clock=self._clock,
                rng=self._rng,
            )
        peer.worker_id = self.worker_id  # names the taker of a stream; registered here only
        before = peer.bytes_down
        try:
            return call(peer)
        except Refused as exc:
            if exc.reason == "wrong_aggregator":
                del self._elsewhere[block]  # it moved: ask the directory again next round
            raise
        finally:
            self.bytes_down += peer.bytes_down - before

    # ------------------------------------------------------------------ relayed streams

    def take_stream(
        self, block: int, *, wait: float = 0.0, dest: Path | None = None
    ) -> RelayStream | None:
        """route = relay: a stream of `block` (the block before this worker's) to train on,
        waiting up to `wait` s for one; None when none came. Read from the aggregator that
        serves `block`; written to `dest` as it arrives (then read a step at a time), else
        held in memory."""
        if block in self._elsewhere:
            return self._take_elsewhere(block, wait, dest)
        params = {"wait": wait}
        response = self.request("GET", f"/v1/blocks/{block}/streams", params=params, to_file=dest)
        if dest is None:
            self.bytes_down += len(response.content)
        if response.status_code == 204:
            return None
        if response.status_code >= 400:
            refusal = self._refusal(response)
            if refusal.reason == "wrong_aggregator":
                return self._take_elsewhere(block, wait, dest)
            raise refusal
        try:
            if dest is not None:
                return RelayStream.from_file(dest)
            return RelayStream.from_body(response.content)
        except WireError as exc:
            raise ProtocolError(f"the aggregator sent an unreadable stream: {exc.detail}") from exc

    def _take_elsewhere(self, block: int, wait: float, dest: Path | None) -> RelayStream | None:
        stream: RelayStream | None = self._elsewhere_call(
            block, lambda peer: peer.take_stream(block, wait=wait, dest=dest)
        )
        return stream

    def push_stream(self, block: int, round: int, body: StreamBody) -> PushResult:
        """route = relay: this worker's stream of `round`, after its delta; uploaded from its
        chunks (a spooled stream is never held whole). A refusal is returned, not raised."""
        response = self.request(
            "POST",
            f"/v1/blocks/{block}/streams",
            params={"round": round},
            content=body.chunks,
            headers={"Content-Type": CONTENT_TYPE, "Content-Length": str(body.size)},
        )
        self.bytes_up += body.size
        return self._push_result(response, body.size)

    def _version(
        self, url: str, block: int, version: int, base: View | None
    ) -> tuple[Tensors, int, View | None]:
        """A committed version's tensors (fp32), the bytes its answer carried and the view
        then held (None without a pull codec): the view `base` when it is that version, else
        a delta from it (a pull wire with a codec), else the whole version."""
        view = base if base is not None and base.block == block else None
        if view is not None and view.version == version:
            return fp32(view.tensors), 0, view
        codec = pull_codec(self.pull_wire)
        nbytes = 0
        if codec is not None and view is not None and view.version < version:
            chained, nbytes = self._chain(url, view, version, codec)
            if chained is not None:
                return fp32(chained.tensors), nbytes, chained
        held = self._held if self._held is not None and self._held[0] == url else None
        headers = {} if held is None else {"If-None-Match": held[1]}
        response = self.request("GET", url, headers=headers, follow_redirects=True)
        self.bytes_down += len(response.content)
        nbytes += len(response.content)
        if response.status_code == 304 and held is not None:
            tensors = held[2]
        else:
            if response.status_code >= 400:
                raise self._refusal(response)
            tensors = self._version_body(response.content, url, block, version)
            etag = response.headers.get("ETag")
            self._held = None if etag is None else (url, etag, tensors)
        if codec is None:
            return fp32(tensors), nbytes, None
        return fp32(tensors), nbytes, View(block, version, as_held(tensors, self.exact_pulls))

    def _chain(
        self, url: str, base: View, version: int, codec: DeltaWire
    ) -> tuple[View | None, int]:
        """`version` from `base` as one delta from the view, or under exact pulls as the commits
        of each version after `base`'s in turn; the view and the bytes received (no view: pull
        it whole)."""
        if not self.exact_pulls:
            return self._delta(url, base, version, codec)
        stem = url.rstrip("/").rsplit("/", 1)[0]  # .../versions
        view: View | None = base
        total = 0
        for v in range(base.version + 1, version + 1):
            assert view is not None
            view, nbytes = self._delta(f"{stem}/{v}", view, v, codec)
            total += nbytes
            if view is None:
                break
        return view, total

    def _delta(
        self, url: str, base: View, version: int, codec: DeltaWire
    ) -> tuple[View | None, int]:
        """`version` as a delta from `base` (under exact pulls: its commit, one URL for every
        worker), and the bytes received; no view after any refusal (unknown_base or
        version_gone after a restart, an old aggregator) or a bad body: the caller then pulls
        the whole version."""
        params = (
            {"wire": self.pull_wire}
            if self.exact_pulls
            else {"base": base.id, "wire": self.pull_wire}
        )
        response = self.request(
            "GET", url.rstrip("/") + "/delta", params=params, follow_redirects=True
        )
        self.bytes_down += len(response.content)
        if response.status_code != 200:
            log.info("delta pull of version %d refused (HTTP %d)", version, response.status_code)
            if response.status_code == 400:  # wrong_wire: restarted with another pull wire
                self.pull_wire = FULL  # whole pulls until the next registration says again
            return None, len(response.content)
        read = read_commit if self.exact_pulls else read_delta
        try:
            return read(response.content, base, version, codec), len(response.content)
        except ProtocolError as exc:
            log.warning("delta pull of version %d unusable (%s); pulling it whole", version, exc)
            return None, len(response.content)

    def _version_body(self, body: bytes, url: str, block: int, version: int) -> Tensors:
        """The tensors of a committed version's body, refused unless it names that version."""
        meta, tensors = self._weights(body)
        if (meta.get("block"), meta.get("version")) != (str(block), str(version)):
            raise ProtocolError(
                f"{url} holds block {meta.get('block')} version {meta.get('version')}, "
                f"not block {block} version {version}"
            )
        return tensors

    @staticmethod
    def _weights(body: bytes) -> tuple[dict[str, str], Tensors]:
        """The metadata and tensors of a weights body, as they travelled (the wire dtype)."""
        try:
            decoded = decode(body)
        except WireError as exc:
            raise ProtocolError(f"the aggregator sent unreadable weights: {exc.detail}") from exc
        return decoded.metadata, decoded.to_torch()

    def push(
        self,
        block: int,
        delta: Tensors,
        *,
        base_version: int,
        round: int,
        tokens: int,
        loss: float | None = None,
        dtype: str = "fp16",
    ) -> PushResult:
        body = update_body(
            block,
            delta,
            base_version=base_version,
            round=round,
            tokens=tokens,
            loss=loss,
            worker_id=self.worker_id,
            dtype=dtype,
        )
        return self.push_bytes(block, body)

    def push_bytes(self, block: int, body: bytes) -> PushResult:
        """Push an encoded update; a refusal is returned (not raised) with its reason."""
        response = self.request(
            "POST",
            f"/v1/blocks/{block}/updates",
            content=body,
            headers={"Content-Type": CONTENT_TYPE},
        )
        self.bytes_up += len(body)
        return self._push_result(response, len(body))

    def _push_result(self, response: httpx.Response, size: int) -> PushResult:
        """The answer to a push of `size` bytes (an update or a stream): its refusal, if any."""
        self.bytes_down += len(response.content)
        try:
            doc = dict(response.json())
        except ValueError:
            doc = {}
        if response.status_code >= 400:
            refusal = self._refusal(response)
            return PushResult(
                False, refusal.reason, refusal.detail, response.status_code, size, doc
            )
        return PushResult(bool(doc.get("accepted")), "", "", response.status_code, size, doc)
