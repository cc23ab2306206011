"""serve-block, serve and plan --shape: examples in --help, and one clear line with exit code 2
for every bad input (nothing starts serving)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from blocktrain.cli.main import main
from tests.cli.test_cli import fails_cleanly


def test_help_shows_examples(capsys):
    for cmd in ("serve-block", "serve", "plan"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out, cmd
    assert main(["plan", "--shape", "seed-75b"]) == 0
    assert "75.80B" in capsys.readouterr().out


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def test_bad_serve_block_input(capsys, runs, tmp_path, busy_port):
    run = str(runs.blocktrain)
    fails_cleanly(capsys, ["serve-block", run, "--blocks", "a", "--port", "0"], "--blocks 'a'")
    fails_cleanly(capsys, ["serve-block", run, "--blocks", "1,1", "--port", "0"], "distinct")
    fails_cleanly(capsys, ["serve-block", run, "--blocks", "5", "--port", "0"], "blocks 0..2")
    fails_cleanly(
        capsys,
        ["serve-block", str(tmp_path / "none"), "--blocks", "0", "--port", "0"],
        "does not exist",
    )
    fails_cleanly(
        capsys, ["serve-block", run, "--blocks", "0", "--port", str(busy_port)], "cannot listen"
    )
    fails_cleanly(capsys, ["serve-block", run, "--blocks", "0", "--port", "70000"], "0..65535")
    fails_cleanly(
        capsys,
        ["serve-block", run, "--blocks", "0", "--port", "0", "--next", "localhost:8102"],
        "--next 'localhost:8102'",
    )
    fails_cleanly(
        capsys,
        ["serve-block", f"a={run}", f"a={runs.reference}", "--blocks", "0", "--port", "0"],
        "model names must differ",
    )
    fails_cleanly(
        capsys, ["serve-block", f"a b={run}", "--blocks", "0", "--port", "0"], "NAME=RUN_DIR"
    )
    fails_cleanly(
        capsys,
        ["serve-block", run, "--blocks", "0", "--port", "0", "--set", "hop_ms=-1"],
        "hop_ms = -1",
    )


def test_bad_serve_input(capsys, busy_port):
    fails_cleanly(capsys, ["serve", "--hosts", "ftp://a:1", "--port", "0"], "--hosts entry")
    fails_cleanly(capsys, ["serve", "--hosts", "", "--port", "0"], "at least one block host")
    fails_cleanly(capsys, ["serve", "--hosts", "http://a:1,http://a:1", "--port", "0"], "twice")
    fails_cleanly(
        capsys, ["serve", "--hosts", "http://a:1", "--port", str(busy_port)], "cannot listen"
    )
    fails_cleanly(
        capsys,
        ["serve", "--hosts", "http://a:1", "--port", "0", "--set", "timeout_s=0"],
        "timeout_s = 0",
    )


def test_a_bad_draft_corpus_is_one_clear_line(capsys, tmp_path, runs):
    serve = ["serve", "--hosts", "http://a:1", "--port", "0", "--draft-corpus"]
    fails_cleanly(capsys, [*serve, str(tmp_path / "none")], "--draft-corpus")
    corpus = runs.blocktrain.parent / "corpus"
    fails_cleanly(capsys, [*serve, str(corpus), "--set", "draft_order=9"], "order = 9")
    tokens = [*serve[:-1], "--set", f"tokens_file={tmp_path / 'none'}"]
    fails_cleanly(capsys, tokens, "--set tokens_file=")  # serve's own setting: the tokens' file
    model = [*serve[:-1], "--draft-model"]
    fails_cleanly(capsys, [*model, str(tmp_path)], "not a run folder")
    fails_cleanly(capsys, [*model, str(runs.blocktrain)], "takes a --reference one")
    both = [*model, str(runs.reference), "--draft-corpus", str(corpus)]
    fails_cleanly(capsys, both, "not both")
    fails_cleanly(capsys, [*serve[:-1], "--draft-bytes", "4"], "needs a drafter")
    fails_cleanly(capsys, [*serve, str(corpus), "--draft-bytes", "33"], "must lie in 0..32")


def test_bad_plan_shape_input(capsys):
    fails_cleanly(capsys, ["plan", "--shape", "nope"], "unknown shape")
    fails_cleanly(capsys, ["plan", "--shape", "seed-75b", "--set", "span=2"], "replaces")
    fails_cleanly(capsys, ["plan", "--throughput"], "go with --shape")
    fails_cleanly(capsys, ["plan", "--set", "scale=2"], "go with --shape")
    fails_cleanly(
        capsys, ["plan", "--shape", "seed-75b", "--throughput", "--set", "scale=0"], ">= 1"
    )
    fails_cleanly(capsys, ["plan", "--shape", "seed-75b", "--hosts", "4"], "--hosts 4")


def test_a_host_off_loopback_needs_the_secret_and_a_bad_secret_is_one_line(
    capsys, runs, tmp_path, monkeypatch
):
    """Router and hosts authenticate each other, so that nobody else can run work on a host: a host
    reachable from the network refuses to start without the shared secret; the secret is read from
    a file or the environment, never only from the command line."""
    monkeypatch.delenv("BLOCKTRAIN_SERVE_SECRET", raising=False)
    host = ["serve-block", str(runs.blocktrain), "--blocks", "0", "--port", "0"]
    fails_cleanly(capsys, [*host, "--host", "0.0.0.0"], "needs the secret it shares")
    short = tmp_path / "short"
    short.write_text("abc\n")
    fails_cleanly(capsys, [*host, "--secret-file", str(short)], "use at least 16")
    fails_cleanly(capsys, [*host, "--secret-file", str(tmp_path / "none")], "cannot read")
    monkeypatch.setenv("BLOCKTRAIN_SERVE_SECRET", "too-short")
    fails_cleanly(capsys, ["serve", "--hosts", "http://a:1", "--port", "0"], "BLOCKTRAIN_SERVE")


def test_bad_router_limits_are_one_line(capsys, monkeypatch):
    monkeypatch.delenv("BLOCKTRAIN_SERVE_SECRET", raising=False)
    serve = ["serve", "--hosts", "http://a:1", "--port", "0"]
    fails_cleanly(capsys, [*serve, "--rate-limit", "-1"], "--rate-limit -1")
    fails_cleanly(capsys, [*serve, "--set", "max_work=0"], "max_work = 0")
    fails_cleanly(capsys, [*serve, "--set", "max_body_bytes=0"], "max_body_bytes = 0")
    fails_cleanly(capsys, [*serve, "--set", "max_work=100", "max_work_in_flight=10"], "no request")
    fails_cleanly(capsys, [*serve, "--set", "max_work_per_client=100"], "max_work_per_client = 100")
    fails_cleanly(capsys, [*serve, "--set", "send_timeout_s=0"], "send_timeout_s = 0")


def test_bad_tls_input_is_one_line(capsys, runs, tmp_path, monkeypatch):
    monkeypatch.delenv("BLOCKTRAIN_SERVE_SECRET", raising=False)
    host = ["serve-block", str(runs.blocktrain), "--blocks", "0", "--port", "0"]
    fails_cleanly(capsys, [*host, "--tls-cert", "c.pem"], "go together")
    missing = ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")]
    fails_cleanly(capsys, [*host, *missing], "cannot use --tls-cert")
    serve = ["serve", "--hosts", "https://a:1", "--port", "0"]
    fails_cleanly(capsys, [*serve, "--set", f"ca_cert={tmp_path / 'ca.pem'}"], "ca_cert")


def _signal_once_serving(sig: signal.Signals, port: int) -> None:
    """Send `sig` to this process once something answers /healthz on `port`."""
    limit = time.monotonic() + 60
    while time.monotonic() < limit:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    os.kill(os.getpid(), sig)


@pytest.mark.timeout(120)
def test_ctrl_c_or_sigterm_stops_a_server_with_exit_code_0(monkeypatch):
    """Issue 30 (tests/test_newcomer.py): `serve` and `serve-block` say "press Ctrl+C to stop",
    and Ctrl+C ended them with `blocktrain: interrupted` and exit code 130 (SIGTERM: killed by
    the signal) after uvicorn had stopped them cleanly, where the aggregator exits 0. They now
    return 0 (listener.run), and the handlers found before are back after."""
    monkeypatch.delenv("BLOCKTRAIN_SERVE_SECRET", raising=False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        reached: list[signal.Signals] = []

        def recorder(signum, frame, reached=reached):  # where the signal must not arrive
            reached.append(signum)

        before = signal.signal(sig, recorder)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            threading.Thread(target=_signal_once_serving, args=(sig, port), daemon=True).start()
            assert main(["serve", "--hosts", "http://127.0.0.1:9", "--port", str(port)]) == 0
            assert reached == [], "the signal stopped the server, and went no further"
            assert signal.getsignal(sig) is recorder, "the handler found before is back"
        finally:
            signal.signal(sig, before)
