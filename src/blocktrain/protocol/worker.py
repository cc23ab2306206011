"""The worker side: an HTTP client of the aggregator, and the loop a worker runs.

    register -> [wait for a new round -> pull -> train H local steps -> push delta] ...

`AggregatorClient` is httpx with explicit timeouts and an injectable transport (or a whole
`httpx.Client`, e.g. a FastAPI TestClient, so that tests run client and app in one process).
Transient failures (connection errors, timeouts, 5xx) are retried with exponential backoff and
full jitter; a 4xx is a refusal (`errors.Refused`) and is never retried blindly.

`WorkerLoop` knows nothing of the model: it drives any `LocalTrainer` (`load` weights, `train`
H steps, return the `delta`); the CLI plugs in `training.local.LocalBlockTrainer`. It re-syncs
by itself: after a refusal it pulls the open round again, after an aggregator restart its
retries reconnect, and if its worker id is gone it registers anew. A stop event (set on
SIGTERM) ends it between local steps; it then tells the aggregator it is leaving.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import torch

from blocktrain.errors import ProtocolError, Refused, Unreachable
from blocktrain.protocol.wire import CONTENT_TYPE, WireError, decode, update_body

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=60.0, pool=10.0)
LONG_POLL_S = 5.0
"""How long a worker waits in one long poll for the next round (also bounds how long a
SIGTERM can take to be noticed while waiting)."""

RESYNC_REASONS = frozenset({"late", "stale_version", "future_round", "duplicate"})
"""Refusals after which a worker simply pulls the open round again."""
REREGISTER_REASONS = frozenset({"unknown_worker", "not_assigned", "not_your_worker"})
"""Refusals after which a worker registers again."""
FATAL_REASONS = frozenset({"missing_token", "invalid_token", "revoked_token"})
"""Refusals no retry can fix."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: sleep U(0, min(cap, base * 2^attempt))."""

    base_s: float = 0.2
    cap_s: float = 5.0
    give_up_after_s: float = 300.0
    """Total time without an answer after which `Unreachable` is raised."""

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2 ** min(attempt, 30)))


@dataclass(frozen=True)
class Registration:
    worker_id: int
    block: int
    data_seed: int
    local_steps: int
    wire_dtype: str


@dataclass(frozen=True)
class Pulled:
    tensors: Tensors
    block: int
    version: int
    round: int
    deadline_in: float | None
    nbytes: int


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    reason: str
    detail: str
    status: int
    nbytes: int
    body: dict[str, Any]


class AggregatorClient:
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
        self._rng = rng or random.Random()
        self.worker_id: int | None = None
        self.bytes_down = 0
        self.bytes_up = 0

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ plumbing

    def _headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}"}
        if self.worker_id is not None:
            headers["X-Worker-Id"] = str(self.worker_id)
        return headers

    def _wait(self, seconds: float) -> bool:
        """Sleep between retries; True when the stop event was set meanwhile."""
        if self._sleep is time.sleep:
            return self.stop.wait(seconds)
        self._sleep(seconds)
        return self.stop.is_set()

    def request(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send with retries on transient failures; a 4xx answer is returned, not raised."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                response = self.http.request(
                    method, path, headers={**self._headers(), **(headers or {})}, **kwargs
                )
                if response.status_code < 500:
                    return response
                problem = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:  # connect, read, write, pool, protocol errors
                problem = f"{type(exc).__name__}: {exc}"
            waited = time.monotonic() - started
            if self.stop.is_set() or waited > self.retry.give_up_after_s:
                raise Unreachable(
                    f"{method} {self.base_url}{path} failed for {waited:.0f}s ({problem})"
                )
            delay = self.retry.delay(attempt, self._rng)
            log.info("%s %s: %s; retrying in %.2fs", method, path, problem, delay)
            attempt += 1
            if self._wait(delay):
                raise Unreachable(f"stopped while retrying {method} {path}")

    @staticmethod
    def _refusal(response: httpx.Response) -> Refused:
        try:
            doc = response.json()
            reason, detail = str(doc.get("reason", "")), str(doc.get("detail", ""))
        except ValueError:
            reason, detail = "", response.text[:200]
        return Refused(reason or f"http_{response.status_code}", detail, response.status_code)

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self.request(method, path, **kwargs)
        self.bytes_down += len(response.content)
        if response.status_code >= 400:
            raise self._refusal(response)
        return dict(response.json())

    # ------------------------------------------------------------------ calls

    def register(self, block: int | None = None, name: str | None = None) -> Registration:
        body: dict[str, Any] = {}
        if block is not None:
            body["block"] = block
        if name is not None:
            body["name"] = name
        self.worker_id = None
        doc = self._json("POST", "/v1/workers", json=body)
        self.worker_id = int(doc["worker_id"])
        return Registration(
            self.worker_id,
            int(doc["block"]),
            int(doc["data_seed"]),
            int(doc["local_steps"]),
            str(doc["wire_dtype"]),
        )

    def leave(self) -> None:
        if self.worker_id is not None:
            self._json("DELETE", f"/v1/workers/{self.worker_id}")

    def config(self) -> dict[str, Any]:
        return self._json("GET", "/v1/config")

    def status(self) -> dict[str, Any]:
        return self._json("GET", "/v1/status")

    def round(self, block: int, *, after: int = -1, wait: float = 0.0) -> dict[str, Any]:
        return self._json("GET", f"/v1/blocks/{block}/round", params={"after": after, "wait": wait})

    def pull(self, block: int) -> Pulled:
        response = self.request("GET", f"/v1/blocks/{block}")
        body = response.content
        self.bytes_down += len(body)
        if response.status_code >= 400:
            raise self._refusal(response)
        try:
            decoded = decode(body)
        except WireError as exc:
            raise ProtocolError(f"the aggregator sent unreadable weights: {exc.detail}") from exc
        meta = decoded.metadata
        deadline_in = response.headers.get("X-Deadline-In") or None
        return Pulled(
            {k: v.float() for k, v in decoded.to_torch().items()},
            int(meta["block"]),
            int(meta["version"]),
            int(meta["round"]),
            None if deadline_in is None else float(deadline_in),
            len(body),
        )

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
        self.bytes_down += len(response.content)
        try:
            doc = dict(response.json())
        except ValueError:
            doc = {}
        if response.status_code >= 400:
            refusal = self._refusal(response)
            return PushResult(
                False, refusal.reason, refusal.detail, response.status_code, len(body), doc
            )
        return PushResult(bool(doc.get("accepted")), "", "", response.status_code, len(body), doc)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


class LocalTrainer(Protocol):
    """What the loop needs of a block replica's trainer."""

    def load(self, weights: Tensors) -> None:
        """Start a round from these weights (the optimizer state carries over)."""

    def train(
        self, steps: int, first_step: int, should_stop: Callable[[], bool]
    ) -> dict[str, float]:
        """Run up to `steps` local updates; returns at least "tokens", "loss", "steps"."""
        ...

    def delta(self) -> Tensors:
        """theta_local - theta_base for the weights last loaded."""
        ...


TrainerFactory = Callable[[Registration, dict[str, Any]], LocalTrainer]
"""Builds the trainer for a registration, given the aggregator's /v1/config."""


@dataclass
class WorkerReport:
    """What a worker did, for logs and the cluster summary."""

    worker_id: int | None = None
    block: int | None = None
    rounds: int = 0
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    local_steps: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    last_loss: float | None = None
    stopped_by: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class WorkerLoop:
    """pull -> train -> push, round after round, until the block is done or `stop` is set."""

    def __init__(
        self,
        client: AggregatorClient,
        make_trainer: TrainerFactory,
        *,
        block: int | None = None,
        name: str | None = None,
        stop: threading.Event | None = None,
        max_rounds: int | None = None,
    ) -> None:
        self.client = client
        self.make_trainer = make_trainer
        self.want_block = block
        self.name = name
        self.stop = stop or client.stop
        self.client.stop = self.stop
        self.max_rounds = max_rounds
        self.report = WorkerReport()
        self._registration: Registration | None = None
        self._trainer: LocalTrainer | None = None
        self._config: dict[str, Any] | None = None

    def _register(self) -> Registration:
        reg = self.client.register(self.want_block, self.name)
        if self._registration is None or reg.block != self._registration.block:
            if self._config is None:
                self._config = self.client.config()
            self._trainer = self.make_trainer(reg, self._config)
        self._registration = reg
        self.report.worker_id, self.report.block = reg.worker_id, reg.block
        log.info(
            "worker %d on block %d (data seed %d, H = %d)",
            reg.worker_id,
            reg.block,
            reg.data_seed,
            reg.local_steps,
        )
        return reg

    def run(self) -> WorkerReport:
        try:
            self._run()
        except Unreachable:
            if not self.stop.is_set():
                raise
            self.report.stopped_by = "signal"
        finally:
            if self.stop.is_set() and self.report.stopped_by in ("", "signal"):
                self.report.stopped_by = "signal"
            if self.report.stopped_by in ("signal", "max_rounds"):
                self._say_goodbye()  # so that the block stops waiting for this replica
            self.report.bytes_down = self.client.bytes_down
            self.report.bytes_up = self.client.bytes_up
        return self.report

    def _say_goodbye(self) -> None:
        stop, self.client.stop = self.client.stop, threading.Event()
        self.client.retry = RetryPolicy(base_s=0.1, cap_s=0.5, give_up_after_s=2.0)
        try:
            self.client.leave()
        except ProtocolError as exc:
            log.info("could not say goodbye: %s", exc)
        finally:
            self.client.stop = stop

    def _run(self) -> None:
        reg = self._register()
        last_round = -1
        while not self.stop.is_set():
            if self.max_rounds is not None and self.report.rounds >= self.max_rounds:
                self.report.stopped_by = "max_rounds"
                return
            try:
                info = self.client.round(reg.block, after=last_round, wait=LONG_POLL_S)
                if info["done"]:
                    self.report.stopped_by = "done"
                    return
                if info["round"] <= last_round:
                    continue  # the long poll timed out; ask again
                pulled = self.client.pull(reg.block)
            except Refused as exc:
                new = self._handle_refusal(exc, reg)
                if self.report.stopped_by:
                    return
                if new.worker_id != reg.worker_id:
                    reg, last_round = new, -1
                continue
            assert self._trainer is not None
            self._trainer.load(pulled.tensors)
            logs = self._trainer.train(
                reg.local_steps, pulled.round * reg.local_steps, self.stop.is_set
            )
            self.report.local_steps += int(logs.get("steps", 0))
            if self.stop.is_set():
                return
            self.report.last_loss = float(logs["loss"])
            result = self.client.push(
                reg.block,
                self._trainer.delta(),
                base_version=pulled.version,
                round=pulled.round,
                tokens=int(logs["tokens"]),
                loss=float(logs["loss"]),
                dtype=reg.wire_dtype,
            )
            self.report.rounds += 1
            last_round = pulled.round
            if result.accepted or result.reason == "duplicate":  # a retried push that got in
                self.report.accepted += 1
                continue
            self.report.refused[result.reason] = self.report.refused.get(result.reason, 0) + 1
            log.info("round %d refused: %s (%s)", pulled.round, result.reason, result.detail)
            new = self._handle_refusal(Refused(result.reason, result.detail, result.status), reg)
            if self.report.stopped_by:
                return
            if new.worker_id != reg.worker_id:
                reg, last_round = new, -1

    def _handle_refusal(self, exc: Refused, reg: Registration) -> Registration:
        if exc.reason == "done":
            self.report.stopped_by = "done"
            return reg
        if exc.reason in FATAL_REASONS:
            raise exc
        if exc.reason in REREGISTER_REASONS:
            log.info("re-registering after %s", exc.reason)
            return self._register()
        if exc.reason in RESYNC_REASONS:
            return reg  # the next iteration pulls the open round
        # a content refusal (norm, non-finite, ...): this replica's state is suspect; start
        # the next round from the aggregator's weights, as after any refusal
        log.warning("update refused for its content: %s (%s)", exc.reason, exc.detail)
        return reg
