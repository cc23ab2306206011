"""Secrets and TLS: tokens from a file or the environment, never needed on the
command line; HTTPS with a one-command self-signed certificate, end to end."""

from __future__ import annotations

import pytest

from blocktrain.cli.main import main
from blocktrain.errors import ConfigError, Unreachable
from blocktrain.listener import ThreadedServer, bind
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.retrying import RetryPolicy
from blocktrain.tls import TlsFiles, tls_pair
from tests.protocol.conftest import FakeClock, add_token, make_state

from .test_cli import fails_cleanly


@pytest.fixture
def served(tmp_path):
    """An aggregator on loopback over HTTPS with a certificate from `blocktrain tls`."""
    assert main(["tls", "self-signed", "--out", str(tmp_path / "tls")]) == 0
    tls = TlsFiles(str(tmp_path / "tls" / "cert.pem"), str(tmp_path / "tls" / "key.pem"))
    state = make_state(tmp_path / "s")
    token = add_token(state, "alice")
    app = create_app(storage=state, clock=FakeClock())
    server = ThreadedServer.start(app, bind("127.0.0.1", 0), tls=tls)
    yield server.url, token, tls
    server.stop()
    state.close()


def test_tls_self_signed_serves_https_that_clients_trust_with_ca_file(served, capsys):
    url, token, tls = served
    assert url.startswith("https://127.0.0.1:")
    client = AggregatorClient(url, token, verify=tls.cert)
    try:
        assert client.config()["blocks"] == 2
    finally:
        client.close()
    untrusting = AggregatorClient(url, token, retry=RetryPolicy(give_up_after_s=0.2))
    with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
        untrusting.config()
    untrusting.close()
    plain = AggregatorClient(
        url.replace("https", "http"), token, retry=RetryPolicy(give_up_after_s=0.2)
    )
    with pytest.raises(Unreachable):
        plain.config()
    plain.close()
    capsys.readouterr()
    fails_cleanly(
        capsys,
        ["tls", "self-signed", "--out", str(tls.cert).rsplit("/", 1)[0]],
        "exists",
    )


def test_the_token_never_needs_the_command_line(served, tmp_path, capsys, monkeypatch):
    """Finding: `--token` on the command line shows in `ps`. `status` (and `worker`, through
    the same helper) read it from --token-file or $BLOCKTRAIN_TOKEN; --token warns."""
    url, token, tls = served
    monkeypatch.delenv("BLOCKTRAIN_TOKEN", raising=False)
    path = tmp_path / "token.txt"
    path.write_text(token + "\n")
    base = ["status", url, "--ca-file", tls.cert, "--timeout", "2"]
    capsys.readouterr()
    assert main([*base, "--token-file", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "uptime" in out and err == ""
    monkeypatch.setenv("BLOCKTRAIN_TOKEN", token)
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert "uptime" in out and err == ""
    monkeypatch.delenv("BLOCKTRAIN_TOKEN")
    assert main([*base, "--token", token]) == 0
    assert "shows in `ps`" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    fails_cleanly(capsys, [*base, "--token-file", str(tmp_path / "empty")], "is empty")
    fails_cleanly(capsys, [*base, "--token-file", str(tmp_path / "none")], "cannot read")
    fails_cleanly(capsys, [*base, "--token-file", str(path), "--token", "x"], "not both")
    fails_cleanly(capsys, base, "no token")


def test_aggregator_refuses_bad_limits_and_tls_files(tmp_path, capsys):
    state = tmp_path / "s"
    make_state(state).close()
    fails_cleanly(
        capsys, ["aggregator", "--state", str(state), "--rate-limit", "0"], "--rate-limit"
    )
    fails_cleanly(
        capsys,
        ["aggregator", "--state", str(state), "--set", "max_connections=0"],
        "max_connections",
    )
    fails_cleanly(
        capsys,
        ["aggregator", "--state", str(state), "--set", "max_connections_per_address=0"],
        "max_connections_per_address",
    )
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate")
    fails_cleanly(
        capsys,
        ["aggregator", "--state", str(state), "--tls-cert", str(bogus), "--tls-key", str(bogus)],
        "cannot use --tls-cert",
    )
    missing = ["--tls-cert", str(bogus), "--tls-key", str(tmp_path / "none.pem")]
    fails_cleanly(
        capsys,
        ["aggregator", "--state", str(state), *missing],
        f"cannot use --tls-cert {bogus} with --tls-key {tmp_path / 'none.pem'}: "
        f"{tmp_path / 'none.pem'} does not exist",
    )


def test_one_tls_pair_check_for_every_server(tmp_path):
    """The aggregator, block hosts and the router take --tls-cert/--tls-key through
    `tls_pair`: both or neither, files that exist and serve."""
    assert tls_pair(None, None) is None
    for cert, key in (("c.pem", None), (None, "k.pem")):
        with pytest.raises(ConfigError, match="go together"):
            tls_pair(cert, key)
    with pytest.raises(ConfigError, match=r"cannot use --tls-cert  with --tls-key : .*exist"):
        tls_pair("", "")
    assert main(["tls", "self-signed", "--out", str(tmp_path / "tls")]) == 0
    pair = tls_pair(str(tmp_path / "tls" / "cert.pem"), str(tmp_path / "tls" / "key.pem"))
    assert pair == TlsFiles(str(tmp_path / "tls" / "cert.pem"), str(tmp_path / "tls" / "key.pem"))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "agg.example"])
def test_aggregator_and_router_refuse_plain_http_off_loopback(tmp_path, capsys, host):
    """Issue 58: secure by default on a public address. Without TLS the aggregator and the
    router refuse to listen off loopback (one line naming `blocktrain tls self-signed`, exit 2,
    before the state folder is made or a port is bound)."""
    state = tmp_path / "s"
    argv = ["aggregator", "--state", str(state), "--preset", "tiny", "--host", host, "--port", "0"]
    fails_cleanly(capsys, argv, "blocktrain tls self-signed")
    assert not state.exists(), "nothing was made"
    serve = ["serve", "--hosts", "http://127.0.0.1:9", "--host", host, "--port", "0"]
    line = fails_cleanly(capsys, serve, "blocktrain tls self-signed")
    assert "--insecure-http" in line and f"--host {host}" in line


def test_loopback_tls_or_insecure_http_may_serve(tmp_path, capsys, monkeypatch):
    """Loopback (127.0.0.0/8, ::1, localhost) needs no TLS; off loopback TLS, or the operator's
    --insecure-http (TLS ended by a proxy, a private network), lets the server start."""
    import blocktrain.cli.serve as serve_cli
    import blocktrain.listener as listener
    from blocktrain.tls import is_loopback, require_tls

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        require_tls(host, None, insecure_http=False)
    for host in ("0.0.0.0", "::", "10.0.0.5"):
        assert not is_loopback(host)
        require_tls(host, TlsFiles("c.pem", "k.pem"), insecure_http=False)
        require_tls(host, None, insecure_http=True)
    served: list[str] = []

    def capture(app, sock, *_, **__):
        served.append(sock.getsockname()[0])
        sock.close()

    monkeypatch.setattr(serve_cli, "run", capture)
    monkeypatch.setattr(listener, "run", capture)  # the aggregator imports it as it starts
    serve = ["serve", "--hosts", "http://127.0.0.1:9", "--host", "0.0.0.0", "--port", "0"]
    assert main([*serve, "--insecure-http"]) == 0
    argv = ["aggregator", "--state", str(tmp_path / "s"), "--preset", "tiny", "--port", "0"]
    assert main([*argv, "--host", "0.0.0.0", "--insecure-http", "--effect-probe", "off"]) == 0
    capsys.readouterr()
    assert served == ["0.0.0.0", "0.0.0.0"]
