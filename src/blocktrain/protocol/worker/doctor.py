"""Why a worker cannot reach its aggregator: one check per layer, each with what it found and,
when it fails, what to do. `blocktrain doctor` prints them; `blocktrain join` runs them before
it starts a worker.

    url      the URL is http(s)://HOST[:PORT]
    dns      HOST resolves
    tcp      a connection to HOST:PORT opens
    tls      (https) the handshake succeeds and the certificate is trusted
    http     the aggregator answers (its OpenAPI document names it)
    version  its blocktrain version has our major.minor
    token    the token is accepted (GET /v1/config)
    clock    our clock is within MAX_SKEW_S of the aggregator's (its Date header, read as the
             interval it stands for: `DATE_RESOLUTION_S`)

A check that cannot run because an earlier one failed is skipped, not failed.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

import httpx

from blocktrain import __version__

MAX_SKEW_S = 5.0
"""Deadlines travel as seconds-from-now, so skew does not break rounds; but logs, ledgers and
certificates read wall times, and several seconds of skew means the clock is not synced."""

DATE_RESOLUTION_S = 2.0
"""A Date header is the server's clock cut to the second, and uvicorn refreshes the one it sends
once a second: the aggregator's clock at its answer lies in [Date, Date + 2 s). Read as one
instant, it put a machine +1.9 s from an aggregator on the same machine."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None
    """None: skipped, because an earlier check failed."""
    detail: str

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[self.ok]
        return f"{mark} {self.name:<8} {self.detail}"


def diagnose(
    url: str,
    token: str | None,
    *,
    verify: str | bool = True,
    timeout_s: float = 5.0,
    now: Callable[[], float] = time.time,
    on_config: Callable[[dict[str, Any]], None] | None = None,
) -> list[Check]:
    """Every check, in order (see the module's docstring); `on_config` gets the /v1/config body
    when the token is accepted (the run config: `blocktrain doctor` checks the device with it)."""
    checks: list[Check] = []

    def skip_rest(after: str) -> list[Check]:
        names = ("url", "dns", "tcp", "tls", "http", "version", "token", "clock")
        rest = names[names.index(after) + 1 :]
        return checks + [Check(n, None, f"not checked: {after} failed") for n in rest]

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        checks.append(
            Check("url", False, f"{url!r}: expected http://HOST:PORT or https://HOST:PORT")
        )
        return skip_rest("url")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        checks.append(Check("url", False, f"{url!r}: {exc}"))
        return skip_rest("url")
    host = parts.hostname
    checks.append(Check("url", True, f"{parts.scheme} to {host} port {port}"))

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        checks.append(Check("dns", False, f"{host} does not resolve ({exc.strerror})"))
        return skip_rest("dns")
    addresses = sorted({str(i[4][0]) for i in infos})
    checks.append(Check("dns", True, f"{host} -> {', '.join(addresses[:3])}"))

    started = time.monotonic()
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        checks.append(
            Check(
                "tcp",
                False,
                f"cannot connect to {host}:{port} ({why}); is the aggregator running, and does "
                "a firewall let this port through?",
            )
        )
        return skip_rest("tcp")
    rtt_ms = (time.monotonic() - started) * 1e3
    checks.append(Check("tcp", True, f"connected in {rtt_ms:.1f} ms"))

    with sock:
        if parts.scheme == "https":
            tls = _tls(sock, host, verify)
            checks.append(tls)
            if not tls.ok:
                return skip_rest("tls")
        else:
            checks.append(Check("tls", True, "not used (http): tokens travel in the clear"))

    trust = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
    client = httpx.Client(base_url=url.rstrip("/"), verify=trust, timeout=timeout_s)
    try:
        asked = now()
        try:
            doc = client.get("/openapi.json")
        except httpx.HTTPError as exc:
            checks.append(Check("http", False, f"no HTTP answer: {exc}"))
            return skip_rest("http")
        info = _json(doc).get("info", {}) if doc.status_code == 200 else {}
        if info.get("title") != "BlockTrain aggregator":
            checks.append(
                Check(
                    "http", False, f"answered {doc.status_code}, but not as a blocktrain aggregator"
                )
            )
            return skip_rest("http")
        checks.append(Check("http", True, f"a blocktrain aggregator answered {doc.status_code}"))
        theirs = str(info.get("version", "?"))
        same = theirs.split(".")[:2] == __version__.split(".")[:2]
        checks.append(
            Check(
                "version",
                same,
                f"aggregator {theirs}, this worker {__version__}"
                + ("" if same else ": install the aggregator's version"),
            )
        )
        answered = now()
        if token is None:
            checks.append(Check("token", None, "not checked: no token given"))
            config = doc
        else:
            asked = now()
            config = client.get("/v1/config", headers={"Authorization": f"Bearer {token}"})
            answered = now()
            body = _json(config)
            if config.status_code == 200:
                checks.append(Check("token", True, f"accepted; {body.get('blocks', '?')} blocks"))
                if on_config is not None:
                    on_config(body)
            else:
                reason = body.get("reason", config.status_code)
                checks.append(
                    Check(
                        "token",
                        False,
                        f"refused ({reason}): {body.get('detail', config.text[:200])}",
                    )
                )
        checks.append(_clock(config.headers.get("date"), asked, answered))
    finally:
        client.close()
    return checks


def _tls(sock: socket.socket, host: str, verify: str | bool) -> Check:
    ctx = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
    if verify is False:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock, server_hostname=host) as tls:
            cert = tls.getpeercert() or {}
            version = tls.version()
    except ssl.SSLCertVerificationError as exc:
        return Check(
            "tls",
            False,
            f"CERTIFICATE_VERIFY_FAILED: {exc.verify_message}; for a self-signed certificate, "
            "pass it with --ca-file",
        )
    except (ssl.SSLError, OSError) as exc:
        return Check("tls", False, f"handshake failed: {exc}")
    expires = cert.get("notAfter", "?")
    return Check("tls", True, f"{version}, certificate trusted, expires {expires}")


def _clock(date_header: str | None, asked: float, answered: float) -> Check:
    """Our clock against the aggregator's, from the Date header of an answer to a request we
    sent at `asked` and had answered at `answered` (our clock): the least skew that the two
    intervals allow, 0 when they overlap."""
    if not date_header:
        return Check("clock", None, "not checked: the answer had no Date header")
    try:
        theirs = parsedate_to_datetime(date_header).timestamp()
    except (TypeError, ValueError):
        return Check("clock", None, f"not checked: unreadable Date header {date_header[:40]!r}")
    ahead = asked - (theirs + DATE_RESOLUTION_S)  # > 0: we are ahead by at least that
    behind = theirs - answered  # > 0: we are behind by at least that
    skew = max(ahead, 0.0) - max(behind, 0.0)
    if skew == 0:
        return Check(
            "clock",
            True,
            f"within {DATE_RESOLUTION_S:.0f} s of the aggregator's (its Date header's resolution)",
        )
    ok = abs(skew) <= MAX_SKEW_S
    hint = "" if ok else "; sync this machine's clock (NTP)"
    return Check("clock", ok, f"this machine is at least {skew:+.1f} s from the aggregator{hint}")


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
