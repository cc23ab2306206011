"""Flags that no test touched and no document named (docs/rooms-metrics.md, "CLI surface before
and after"), kept because a user has a use for each: each does what its help says. (`eval --set
temperature`, `distill --lr`, `simulate --eval-every` and `cluster --set round_eval_sweeps` are held
beside their commands' other tests.)"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import blocktrain.cli.generate as generate_cli
import blocktrain.cli.serve_block as serve_block_cli
from blocktrain.cli.main import main
from blocktrain.model import Sampling
from blocktrain.serving.host.loading import write_untrained_run
from tests.cli.test_cli import fails_cleanly
from tests.conftest import micro_config


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_tls_self_signed_days_sets_the_validity(tmp_path: Path, capsys) -> None:
    assert main(["tls", "self-signed", "--out", str(tmp_path), "--days", "2"]) == 0
    capsys.readouterr()

    def valid_for(seconds: int) -> bool:
        check = ["openssl", "x509", "-noout", "-in", str(tmp_path / "cert.pem"), "-checkend"]
        return subprocess.run([*check, str(seconds)], capture_output=True).returncode == 0

    assert valid_for(86400) and not valid_for(3 * 86400)


def test_serve_block_public_url_and_batch_window(tmp_path: Path, monkeypatch, capsys) -> None:
    """--set public_url is how the host names itself (/healthz, /v1/info, traces and errors), e.g.
    behind NAT or listening on 0.0.0.0; --batch-window-ms is its batcher's gather window."""
    run = write_untrained_run(micro_config(), tmp_path / "m")
    served: dict[str, Any] = {}

    def capture(app: Any, sock: socket.socket, **_: Any) -> None:
        served["app"] = app
        sock.close()

    monkeypatch.setattr(serve_block_cli, "run", capture)
    url = "https://blocks.example:8101"
    argv = ["serve-block", str(run), "--blocks", "0,1,2", "--port", "0"]
    argv += ["--set", f"public_url={url}"]
    assert main([*argv, "--batch-window-ms", "5"]) == 0
    capsys.readouterr()
    with TestClient(served["app"]) as client:
        assert client.get("/healthz").json()["host"] == url
        info = client.get("/v1/info").json()
    assert info["host"] == url
    assert info["batching"]["window_ms"] == 5.0 and info["batching"]["max_rows"] == 64


def test_generate_temperature_and_top_k_reach_the_sampling(trained, monkeypatch, capsys) -> None:
    """--temperature and --set top_k=K set the byte draws' `Sampling` (0: greedy; k: the k
    likeliest bytes only), whose draws tests/model/test_sampler.py holds; --set takes exactly
    the fields without a flag, and names the flag of one that has it."""
    used: list[Sampling] = []
    real = generate_cli.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        used.append(kwargs["sampling"])
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_cli, "generate", spy)
    argv = [
        "generate",
        str(trained),
        "--prompt",
        "The ",
        "--bytes",
        "8",
        "--set",
        "continuation_only=1",
    ]
    assert main([*argv, "--temperature", "0"]) == 0
    assert main([*argv, "--set", "top_k=1"]) == 0
    assert main(argv) == 0
    assert main([*argv, "--set", "top_p=0.5"]) == 0
    assert capsys.readouterr().out.count("\n") >= 4  # each ends its 8 bytes with a newline
    assert [(s.temperature, s.top_k, s.top_p) for s in used] == [
        (0.0, 0, 1.0),
        (1.0, 1, 1.0),
        (1.0, 0, 1.0),
        (1.0, 0, 0.5),
    ]
    fails_cleanly(capsys, [*argv, "--set", "temperature=0"], "--temperature")


def test_eval_batch_size_changes_memory_not_the_figures(trained, corpus, capsys) -> None:
    """--set batch_size is windows per forward pass: one at a time gives the same CE as sixteen
    (the noise is drawn per batch, so up to its sampling error)."""
    base = ["eval", str(trained), "--data", str(corpus), "--bytes", "256", "--sweeps", "2"]
    ces = []
    for size in ("1", "16"):
        assert main([*base, "--set", f"batch_size={size}", "--json"]) == 0
        ces.append(json.loads(capsys.readouterr().out)["sampler_ce"])
    assert ces[0] == pytest.approx(ces[1], abs=0.01)
