"""TLS files for the package's servers: the certificate and key pair, the check that they can
serve, the refusal to serve plain HTTP off loopback, and a self-signed pair
(`blocktrain tls self-signed`)."""

from __future__ import annotations

import ipaddress
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

from blocktrain.errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """A PEM certificate (chain) and its private key: the server speaks HTTPS."""

    cert: str
    key: str


def check_tls(tls: TlsFiles | None) -> None:
    """A clear ConfigError for a certificate and key that cannot serve (missing, unreadable,
    not matching)."""
    if tls is None:
        return
    for path in (tls.cert, tls.key):
        if not Path(path).is_file():
            raise ConfigError(
                f"cannot use --tls-cert {tls.cert} with --tls-key {tls.key}: {path} does not exist"
            )
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot use --tls-cert {tls.cert} with --tls-key {tls.key}: {exc}"
        ) from None


def is_loopback(host: str) -> bool:
    """Whether a listening address or URL host is reachable from this machine only
    (127.0.0.0/8, ::1, localhost); 0.0.0.0 and :: listen on every interface."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_tls(host: str, tls: TlsFiles | None, insecure_http: bool) -> None:
    """A ConfigError for a server about to listen off loopback over plain HTTP, unless its
    operator said so (`--insecure-http`): its bearer tokens would cross the network in the
    clear, for anyone on the path to read and replay."""
    if tls is not None or insecure_http or is_loopback(host):
        return
    raise ConfigError(
        f"--host {host} is reachable from other machines, and over plain HTTP every token "
        "crosses the network in the clear: serve HTTPS (`blocktrain tls self-signed --out tls "
        f"--host {host if host not in ('0.0.0.0', '::') else 'NAME'}`, then --tls-cert "
        "tls/cert.pem --tls-key tls/key.pem), or give --insecure-http where TLS ends elsewhere "
        "(a reverse proxy) or the network is private"
    )


def tls_pair(cert: str | None, key: str | None) -> TlsFiles | None:
    """The `--tls-cert` and `--tls-key` a server speaks HTTPS with, checked (both or neither
    given, both files exist, and they serve: `check_tls`), or None for plain HTTP."""
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if cert is None or key is None:
        return None
    tls = TlsFiles(cert, key)
    check_tls(tls)
    return tls


def self_signed(out: Path, hosts: list[str], days: int = 365) -> TlsFiles:
    """A self-signed certificate valid for `hosts` (names or IP addresses) and its P-256 key,
    written to out/cert.pem and out/key.pem (mode 600) by `openssl`. Clients trust it with
    `--ca-file out/cert.pem`."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("`openssl` is not on PATH; install it, or bring your own certificate")
    if not hosts or days <= 0:
        raise ConfigError("give at least one --host, and --days must be positive")
    names = []
    for host in hosts:
        try:
            names.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            names.append(f"DNS:{host}")
    out.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(str(out / "cert.pem"), str(out / "key.pem"))
    for path in (files.cert, files.key):
        if Path(path).exists():
            raise ConfigError(f"{path} exists; remove it or choose another --out")
    Path(files.key).touch(mode=0o600)  # private from its first byte: openssl keeps the mode
    command = [
        openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-sha256", "-days", str(days), "-subj", f"/CN={hosts[0]}",
        "-addext", "subjectAltName=" + ",".join(names),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-keyout", files.key, "-out", files.cert,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"openssl failed: {done.stderr.strip().splitlines()[-1:]}")
    return files
