"""`blocktrain doctor` and `blocktrain join` against aggregators served on loopback: one line
per check, a failure named where it happens, and join's worker run after the checks pass."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from blocktrain.cli.main import main
from blocktrain.listener import ThreadedServer, bind
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.worker.doctor import diagnose
from blocktrain.tls import self_signed
from tests.conftest import micro_config
from tests.protocol.conftest import add_token, make_state, run_state


def _served(state, tls=None) -> ThreadedServer:
    return ThreadedServer.start(create_app(storage=state), bind("127.0.0.1", 0), tls=tls)


@pytest.fixture
def aggregator(tmp_path: Path) -> Iterator[tuple[str, str]]:
    state = make_state(tmp_path / "state")
    token = add_token(state, "alice")
    server = _served(state)
    yield server.url, token
    server.stop()
    state.close()


def _lines(capsys) -> dict[str, str]:
    out = capsys.readouterr().out.splitlines()
    return {line.split()[1]: line for line in out if line[:4] in ("ok  ", "FAIL", "skip")}


def test_every_check_passes_against_a_healthy_aggregator(capsys, aggregator, tmp_path) -> None:
    url, token = aggregator
    (tmp_path / "t").write_text(token + "\n")
    assert main(["doctor", url, "--token-file", str(tmp_path / "t")]) == 0
    lines = _lines(capsys)
    assert list(lines) == [
        "url",
        "dns",
        "tcp",
        "tls",
        "http",
        "version",
        "token",
        "clock",
        "codecs",
        "device",
    ]
    assert all(line.startswith("ok") for line in lines.values()), lines
    assert "2 blocks" in lines["token"]
    assert "pushes fp16 (dense), pulls whole versions in fp16" in lines["codecs"]


def test_a_bad_token_fails_the_token_check_with_its_reason(capsys, aggregator) -> None:
    url, _ = aggregator
    assert main(["doctor", url, "--token", "bt_not-a-token"]) == 1
    lines = _lines(capsys)
    assert lines["token"].startswith("FAIL") and "invalid_token" in lines["token"]
    assert lines["http"].startswith("ok") and lines["clock"].startswith("ok")


def test_no_token_skips_only_the_token_check(capsys, aggregator, monkeypatch) -> None:
    monkeypatch.delenv("BLOCKTRAIN_TOKEN", raising=False)
    assert main(["doctor", aggregator[0]]) == 0
    lines = _lines(capsys)
    assert lines["token"].startswith("skip") and lines["codecs"].startswith("skip")


def test_unreachable_and_unresolvable_fail_where_they_fail(capsys) -> None:
    closed = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there now
    assert main(["doctor", url, "--timeout", "2"]) == 1
    lines = _lines(capsys)
    assert lines["dns"].startswith("ok") and lines["tcp"].startswith("FAIL")
    assert all(lines[n].startswith("skip") for n in ("tls", "http", "token", "clock"))
    assert main(["doctor", "http://doctor-test.invalid:8470"]) == 1
    assert _lines(capsys)["dns"].startswith("FAIL")
    assert main(["doctor", "ftp://x"]) == 1
    assert _lines(capsys)["url"].startswith("FAIL")


def test_something_else_on_the_port_is_not_taken_for_an_aggregator(tmp_path) -> None:
    server = ThreadedServer.start(FastAPI(title="something else"), bind("127.0.0.1", 0))
    try:
        checks = {c.name: c for c in diagnose(server.url, "bt_x")}
    finally:
        server.stop()
    assert checks["http"].ok is False and "not as a blocktrain aggregator" in checks["http"].detail
    assert checks["token"].ok is None


def test_clock_skew_is_caught(aggregator) -> None:
    url, token = aggregator
    checks = {c.name: c for c in diagnose(url, token, now=lambda: time.time() + 120)}
    detail = checks["clock"].detail
    # 120 s ahead (60 behind), less up to the Date header's 2 s resolution and the round trip
    assert checks["clock"].ok is False and re.search(r"at least \+(11[7-9]|120)\.", detail), detail
    checks = {c.name: c for c in diagnose(url, token, now=lambda: time.time() - 60)}
    detail = checks["clock"].detail
    assert checks["clock"].ok is False and re.search(r"at least -(5[89]|60)\.", detail), detail


def test_an_aggregator_on_this_machine_is_not_reported_skewed(aggregator) -> None:
    """Issue 30, friction 10: the Date header is the aggregator's clock cut to the second (and
    refreshed once a second), so read as one instant it put this machine +1.9 s from an
    aggregator on the same clock. Read as the interval it stands for, there is no skew, on
    every try."""
    url, token = aggregator
    for _ in range(5):
        clock = {c.name: c for c in diagnose(url, token)}["clock"]
        assert clock.ok is True and clock.detail.startswith("within 2 s"), clock.detail


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_an_untrusted_certificate_fails_the_tls_check(tmp_path: Path) -> None:
    tls = self_signed(tmp_path / "tls", ["127.0.0.1"])
    state = make_state(tmp_path / "state")
    token = add_token(state, "alice")
    server = _served(state, tls)
    try:
        untrusted = {c.name: c for c in diagnose(server.url, token)}
        trusted = {c.name: c for c in diagnose(server.url, token, verify=str(tls.cert))}
    finally:
        server.stop()
        state.close()
    assert untrusted["tls"].ok is False and "CERTIFICATE_VERIFY_FAILED" in untrusted["tls"].detail
    assert "--ca-file" in untrusted["tls"].detail
    assert trusted["tls"].ok and trusted["token"].ok, trusted


def test_join_checks_then_trains(capsys, corpus: Path, tmp_path: Path) -> None:
    state = run_state(tmp_path / "state", micro_config(), {"deadline_s": 30.0, "local_steps": 2})
    token = add_token(state, "alice")
    server = _served(state)
    try:
        (tmp_path / "bad").write_text("bt_wrong\n")
        argv = ["join", server.url, "--data", str(corpus), "--max-rounds", "1"]
        assert main([*argv, "--token-file", str(tmp_path / "bad")]) == 1
        assert "not joining: token failed" in capsys.readouterr().out
        (tmp_path / "good").write_text(token + "\n")
        assert main([*argv, "--token-file", str(tmp_path / "good")]) == 0
        out = capsys.readouterr().out
    finally:
        server.stop()
        state.close()
    assert "ok   token" in out and "1 rounds, 1 accepted" in out, out
