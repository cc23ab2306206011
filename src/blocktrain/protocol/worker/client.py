"""The worker's HTTP client of the aggregator: httpx with an injectable transport (or a whole
`httpx.Client`, e.g. a FastAPI TestClient), retried as `retrying.RetryingHttp` says."""

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
    update_body,
    version_path,
)
from blocktrain.protocol.core.delta_wire import FULL, DeltaWire, pull_codec
from blocktrain.protocol.core.pulls import View, as_held, read_commit, read_delta
from blocktrain.protocol.worker.replies import (
    Pulled,
    PushResult,
    fp32,
    seconds,
    told_steps,
    version_body,
)
from blocktrain.protocol.worker.replies import Registration as Registration
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
        self._clock = clock  # measures the retry budget
        self._rng = rng or random.Random()
        self.worker_id: int | None = None
        self.bytes_down = 0
        self.bytes_up = 0
        self._held: tuple[str, str, Tensors] | None = None
        """(URL, ETag, tensors) of the last version downloaded, revalidated when pulled again."""
        self.pull_wire = FULL
        """The registration's pull wire: with a codec, pulls are deltas from `view`."""
        self.exact_pulls = False
        """Exact pulls: views are fp32, each delta is the commit of the version before."""
        self.view: View | None = None
        """The weights last pulled, as they arrived (a worker's folder keeps it)."""
        self._latest: dict[int, tuple[int, Tensors]] = {}
        """Per other block read with `latest`: (version, tensors)."""
        self._upstream_views: dict[int, View] = {}
        """With a pull codec, per other block read with `latest`: the view held of it."""
        self._elsewhere: dict[int, AggregatorClient] = {}
        """Per block that another aggregator serves: a client of it."""

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
        round in its headers; the bytes come from the version's immutable URL (a cache or CDN
        may serve it; a version held is revalidated, If-None-Match), or as a delta from the
        view held with a `pull_wire` codec."""
        response = self.request(
            "GET", f"/v1/blocks/{block}", params={"redirect": 1}, follow_redirects=False
        )
        self.bytes_down += len(response.content)
        if response.status_code >= 400:
            raise self._refusal(response)
        h = response.headers
        if response.status_code != 303:  # something between us followed the redirect
            raise ProtocolError(f"GET /v1/blocks/{block} answered {response.status_code}, not 303")
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

    def latest(self, block: int) -> Tensors:
        """The latest committed version of another block (fp32), read without a pull (`route =
        features`), from the aggregator that serves it; as deltas with a pull codec."""
        if block in self._elsewhere:
            return self._elsewhere_call(block, lambda peer: peer.latest(block))
        try:
            version = int(self.round(block)["version"])
        except Refused as exc:
            if exc.reason != "wrong_aggregator":
                raise
            return self._elsewhere_call(block, lambda peer: peer.latest(block))
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
        tensors = version_body(response.content, url, block, version)
        self._latest[block] = (version, tensors)
        return fp32(tensors)

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
        """route = relay: a stream of `block` to train on, waiting up to `wait` s (None when none
        came); spooled to `dest` as it arrives, else held in memory."""
        if block in self._elsewhere:
            return self._elsewhere_call(block, lambda p: p.take_stream(block, wait=wait, dest=dest))
        params = {"wait": wait}
        response = self.request("GET", f"/v1/blocks/{block}/streams", params=params, to_file=dest)
        if dest is None:
            self.bytes_down += len(response.content)
        if response.status_code == 204:
            return None
        if response.status_code >= 400:
            refusal = self._refusal(response)
            if refusal.reason == "wrong_aggregator":
                return self._elsewhere_call(
                    block, lambda p: p.take_stream(block, wait=wait, dest=dest)
                )
            raise refusal
        try:
            if dest is not None:
                return RelayStream.from_file(dest)
            return RelayStream.from_body(response.content)
        except WireError as exc:
            raise ProtocolError(f"the aggregator sent an unreadable stream: {exc.detail}") from exc

    def push_stream(self, block: int, round: int, body: StreamBody) -> PushResult:
        """route = relay: this worker's stream of `round`, uploaded from its chunks; a refusal is
        returned, not raised."""
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
        """A committed version's tensors (fp32), the bytes its answer carried and the view then
        held (None without a pull codec): `base` itself, a delta from it, or the whole version."""
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
            tensors = version_body(response.content, url, block, version)
            etag = response.headers.get("ETag")
            self._held = None if etag is None else (url, etag, tensors)
        if codec is None:
            return fp32(tensors), nbytes, None
        return fp32(tensors), nbytes, View(block, version, as_held(tensors, self.exact_pulls))

    def _chain(
        self, url: str, base: View, version: int, codec: DeltaWire
    ) -> tuple[View | None, int]:
        """`version` from `base`: one delta from the view, or under exact pulls each version's
        commit in turn; the view and the bytes received (no view: pull it whole)."""
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
        """`version` as a delta from `base` (under exact pulls: its commit), and the bytes
        received; no view after a refusal or a bad body (the caller then pulls it whole)."""
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
