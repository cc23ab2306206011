"""The plumbing of the worker's client (`RetryingHttp`, `AggregatorClient`'s base): HTTP with
explicit timeouts, retried on transient failures (connection errors, timeouts, 5xx) with
exponential backoff and full jitter, and after a 429's Retry-After; any other 4xx is returned
to the caller, never retried blindly."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from blocktrain.errors import Refused, Unreachable

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=60.0, pool=10.0)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: sleep U(0, min(cap, base * 2^attempt))."""

    base_s: float = 0.2
    cap_s: float = 5.0
    give_up_after_s: float = 300.0
    """Total time without an answer after which `Unreachable` is raised."""

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2 ** min(attempt, 30)))


class RetryingHttp:
    """Requests with retries, the bearer token and the worker id in their headers."""

    base_url: str
    token: str
    http: httpx.Client
    retry: RetryPolicy
    stop: threading.Event
    _sleep: Callable[[float], None]
    _clock: Callable[[], float]
    _rng: random.Random
    worker_id: int | None
    bytes_down: int

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
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        to_file: Path | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send with retries on transient failures; a 4xx answer is returned, not raised.
        `to_file`: a 200's body is streamed into that file (the response then holds none), so
        that a large body is never held whole; a callable `content` is called for each attempt
        (an upload from chunks)."""
        started = self._clock()
        attempt = 0
        content = kwargs.pop("content", None)
        while True:
            try:
                url = path if path.startswith(("http://", "https://")) else self.base_url + path
                if callable(content):
                    kwargs["content"] = content()
                elif content is not None:
                    kwargs["content"] = content
                all_headers = {**self._headers(), **(headers or {})}
                if to_file is None:
                    response = self.http.request(method, url, headers=all_headers, **kwargs)
                else:
                    response = self._download(method, url, all_headers, to_file, **kwargs)
                retry_after = _retry_after(response)
                if response.status_code < 500 and retry_after is None:
                    return response
                problem = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:  # connect, read, write, pool, protocol errors
                problem, retry_after = f"{type(exc).__name__}: {exc}", None
            waited = self._clock() - started
            if self.stop.is_set() or waited > self.retry.give_up_after_s:
                raise Unreachable(
                    f"{method} {self.base_url}{path} failed for {waited:.0f}s ({problem})"
                )
            delay = self.retry.delay(attempt, self._rng)
            if retry_after is not None:  # the server said when; jitter spreads the herd
                delay = retry_after + delay
            log.info("%s %s: %s; retrying in %.2fs", method, path, problem, delay)
            attempt += 1
            if self._wait(delay):
                raise Unreachable(f"stopped while retrying {method} {path}")

    def _download(
        self, method: str, url: str, headers: dict[str, str], dest: Path, **kwargs: Any
    ) -> httpx.Response:
        """One attempt of `request(..., to_file=dest)`: a 200 written to `dest` a chunk at a
        time (and counted in bytes_down), any other answer read as usual."""
        with self.http.stream(method, url, headers=headers, **kwargs) as response:
            if response.status_code != 200:
                response.read()
                return response
            with open(dest, "wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
                    self.bytes_down += len(chunk)
            return response

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


def _retry_after(response: httpx.Response) -> float | None:
    """For a 429, the seconds its Retry-After asks for (1 when absent or unreadable, at most
    60); None for any other answer."""
    if response.status_code != 429:
        return None
    try:
        return min(max(float(response.headers.get("Retry-After", "1")), 0.0), 60.0)
    except ValueError:
        return 1.0
