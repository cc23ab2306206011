"""The decentralised-training commands: help with examples, tokens, export, and one clear line
with exit code 2 for every bad input."""

from __future__ import annotations

import json

import pytest

from blocktrain.cli.main import main
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token
from tests.conftest import micro_config
from tests.protocol.conftest import run_state

from .test_cli import fails_cleanly

COMMANDS = (
    "aggregator",
    "worker",
    "token",
    "status",
    "export",
    "cluster",
    "tls",
    "ban",
    "rollback",
    "doctor",
    "join",
    "report",
)


def test_help_shows_examples(capsys):
    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        assert "examples:" in capsys.readouterr().out, cmd


def test_token_add_prints_the_token_alone(tmp_path, capsys):
    state = tmp_path / "agg"
    assert main(["token", "add", "--state", str(state), "--name", "alice"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("bt_")
    token = out.strip()
    s = StateDir(state)
    row = s.ledger.token_by_hash(hash_token(token))
    assert row is not None and row.name == "alice"
    assert token not in (state / "ledger.sqlite").read_bytes().decode("latin-1"), (
        "the token is stored hashed"
    )
    s.close()
    assert main(["token", "list", "--state", str(state), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["name"] == "alice" and listed["revoked"] is None and "hash" not in listed
    assert main(["token", "revoke", "--state", str(state), "--name", "alice"]) == 0
    capsys.readouterr()
    fails_cleanly(
        capsys, ["token", "revoke", "--state", str(state), "--name", "alice"], "already revoked"
    )
    fails_cleanly(
        capsys, ["token", "add", "--state", str(state), "--name", "alice"], "already exists"
    )
    fails_cleanly(
        capsys, ["token", "revoke", "--state", str(state), "--name", "bob"], "no token named"
    )
    fails_cleanly(
        capsys, ["token", "list", "--state", str(tmp_path / "none")], "holds no aggregator ledger"
    )


def test_aggregator_refuses_bad_starts(tmp_path, capsys):
    fails_cleanly(capsys, ["aggregator", "--state", str(tmp_path / "new")], "give --preset")
    state = tmp_path / "s"
    run_state(state, micro_config(), {}).close()
    fails_cleanly(
        capsys, ["aggregator", "--state", str(state), "--preset", "tiny"], "already holds a run"
    )
    fails_cleanly(
        capsys, ["aggregator", "--state", str(state), "--tls-cert", "x.pem"], "go together"
    )
    fails_cleanly(capsys, ["aggregator", "--state", str(state), "--deadline", "0"], "deadline_s")


def test_worker_and_status_refuse_bad_input(capsys, monkeypatch):
    monkeypatch.delenv("BLOCKTRAIN_TOKEN", raising=False)
    fails_cleanly(capsys, ["worker", "--aggregator", "http://127.0.0.1:1"], "no token")
    fails_cleanly(
        capsys,
        ["worker", "--aggregator", "127.0.0.1:1", "--token", "t"],
        "is not an http(s)://HOST:PORT URL",
    )
    fails_cleanly(capsys, ["status", "http://127.0.0.1:1"], "no token")
    fails_cleanly(
        capsys,
        ["cluster", "--workers", "0", "--rounds", "1", "--out", "x"],
        "--workers must be positive",
    )


def test_cluster_with_fewer_workers_than_blocks_is_refused_before_anything_is_written(
    capsys, tmp_path
):
    """Each worker trains one block: 2 workers for tiny's 3 blocks used to run until every
    worker had finished and then fail ("every worker exited before the end"), block 2 never
    trained. It is one line now, before the run folder exists; a reference (DiLoCo) cluster
    trains one unit and takes any count."""
    out = tmp_path / "c"
    argv = ["cluster", "--workers", "2", "--preset", "tiny", "--rounds", "1", "--out", str(out)]
    line = fails_cleanly(capsys, argv, "--workers 2 for 3 blocks")
    assert "block(s) [2] would get none" in line and "use --workers 3" in line
    assert not out.exists()


def test_cluster_overwrite_with_missing_data_leaves_the_old_run_whole(capsys, tmp_path):
    """--overwrite removed the old run's state, logs, model and summary first, so a wrong
    --data after it lost the old run and ran nothing. The data is read before anything goes."""
    out = tmp_path / "c"
    old = {"state/ledger.sqlite": b"ledger", "summary.json": b"{}", "model/data.json": b"{}"}
    for name, body in old.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(body)
    argv = ["cluster", "--workers", "3", "--preset", "tiny", "--rounds", "1", "--out", str(out)]
    fails_cleanly(capsys, [*argv, "--overwrite", "--data", str(tmp_path / "nope")], "nope")
    assert {name: (out / name).read_bytes() for name in old} == old


def test_status_of_an_unreachable_aggregator_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("BLOCKTRAIN_TOKEN", "t")
    fails_cleanly(capsys, ["status", "http://127.0.0.1:9", "--timeout", "0.3"], "failed")


def test_create_state_derives_the_bounds_from_the_config(tmp_path):
    cfg = micro_config()
    state = run_state(tmp_path / "s", cfg, {"local_steps": 4, "deadline_s": 9.0})
    s = state.settings()
    assert s.local_steps == 4 and s.deadline_s == 9.0
    assert s.max_tokens == 2 * 4 * cfg.train.batch_size * cfg.model.seq_len
    assert 0 < s.max_delta_norm < 100
    assert state.run_config() == cfg.to_dict()
    state.close()


def test_export_writes_a_run_that_eval_reads(tmp_path, corpus, capsys):
    state = tmp_path / "s"
    run_state(state, micro_config(), {}).close()
    out = tmp_path / "model"
    assert main(["export", "--state", str(state), "--out", str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    assert (
        main(["eval", str(out), "--data", str(corpus), "--bytes", "64", "--sweeps", "1", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "blocktrain" and result["from_noise_ce"] > 0
    line = fails_cleanly(
        capsys, ["export", "--state", str(state), "--out", str(out)], "already holds a run"
    )
    # issue 30 (tests/test_newcomer.py): it said "pass --resume to continue it", which export
    # has not
    assert line.endswith(
        "already holds a run; pass --overwrite to replace it, or choose another --out"
    )
    fails_cleanly(
        capsys,
        ["export", "--state", str(tmp_path / "none"), "--out", str(tmp_path / "m2")],
        "holds no aggregator state",
    )


def test_aggregator_serves_on_a_socket_that_says_tcp(tmp_path, capsys, monkeypatch):
    """asyncio switches Nagle off (TCP_NODELAY) only on sockets created with IPPROTO_TCP;
    without it a keep-alive response waits for the client's delayed ACK (44 ms measured)."""
    import signal
    import socket

    import uvicorn

    served: list[socket.socket] = []

    def fake_run(self, sockets):  # what uvicorn would serve on, without serving
        served.extend(sockets)

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # keep pytest's own handlers
    state = tmp_path / "s"
    run_state(state, micro_config(), {}).close()
    assert main(["aggregator", "--state", str(state), "--port", "0"]) == 0
    (sock,) = served
    assert sock.proto == socket.IPPROTO_TCP, sock
    assert "listening on http://127.0.0.1:" in capsys.readouterr().err


def test_settings_flags_are_derived_from_the_declarations(capsys):
    from blocktrain.protocol.core.settings import declared

    for cmd, simulated_only in (("aggregator", False), ("cluster", False), ("simulate", True)):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        for f, s in declared():
            offered = s.simulated or not simulated_only
            if s.flag:
                assert (s.flag in text) == offered, (cmd, s.flag)
            else:  # --set NAME=VALUE, named in the group's description
                assert (f.name in text) == offered, (cmd, f.name)


def test_the_live_evaluation_flags_are_checked_before_the_state_is_made(
    tmp_path, capsys, monkeypatch, corpus
):
    """--set live_eval_every and its slice: a bad value, an aggregator of some blocks (it cannot
    assemble the model) or no data each stop with one line, and nothing is written."""
    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    state = tmp_path / "state"
    start = ["aggregator", "--state", str(state), "--preset", "tiny", "--port", "0"]
    data = ["--data", str(corpus)]
    for bad, match in (
        (
            ["--set", "live_eval_every=-1"],
            "aggregator setting live_eval_every = -1 must be >= 0 (0: off)",
        ),
        (["--set", "live_eval_bytes=20000"], "live_eval_bytes = 20000 must lie in [1, 16384]"),
        (["--set", "live_eval_sweeps=0"], "live_eval_sweeps = 0 must lie in [1, 64]"),
        (
            ["--set", "live_eval_every=2", "--blocks", "0"],
            "--set live_eval_every=2 evaluates the assembled model",
        ),
    ):
        fails_cleanly(capsys, [*start, *data, *bad], match)
    fails_cleanly(
        capsys,
        [*start, "--effect-probe", "off", "--set", "live_eval_every=2"],
        "--set live_eval_every=2 needs the data",
    )
    assert not state.exists()


def test_a_failed_first_start_leaves_nothing_and_the_corrected_one_starts(
    tmp_path, capsys, monkeypatch, corpus
):
    """The probe's data and the port are checked before the state folder is written; what
    fails later still leaves no half-made state. The corrected command then simply starts."""
    import signal
    import socket

    import uvicorn

    from blocktrain.errors import ConfigError
    from blocktrain.protocol.http import app as app_module

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: None)
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    state = tmp_path / "state"
    start = ["aggregator", "--state", str(state), "--preset", "tiny", "--port", "0"]
    fails_cleanly(capsys, start, "the effect probe needs the data")
    assert not state.exists()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        fails_cleanly(capsys, [*start, "--data", str(corpus), "--port", port], "cannot listen")
    assert not state.exists()
    state.mkdir()
    (state / "README").write_text("mine")

    def broken(*_args, **_kwargs):
        raise ConfigError("the app could not be built")

    with monkeypatch.context() as m:
        m.setattr(app_module, "create_app", broken)
        fails_cleanly(capsys, [*start, "--data", str(corpus)], "could not be built")
    assert sorted(p.name for p in state.iterdir()) == ["README"]
    assert main([*start, "--data", str(corpus)]) == 0
    assert "listening on http://127.0.0.1:" in capsys.readouterr().err
    assert StateDir(state).initialised


def test_a_typo_in_an_aggregators_url_is_one_line(capsys, tmp_path, monkeypatch):
    """Issue 30 (tests/test_newcomer.py): a port with a typo (`:8470x`) made `worker` and
    `status` end in httpx's traceback (exit 1), and `aggregator --peer` saved the URL for its
    workers to choke on; each is now one line, exit 2, nothing written."""
    monkeypatch.setenv("BLOCKTRAIN_TOKEN", "bt_x")
    for url in ("http://127.0.0.1:8470x", "http://[::1", "http://:8470"):
        fails_cleanly(capsys, ["worker", "--aggregator", url], f"--aggregator {url!r} is not an")
        fails_cleanly(capsys, ["status", url], f"URL {url!r} is not an http(s)://HOST:PORT URL")
    state = tmp_path / "agg0"
    argv = ["aggregator", "--state", str(state), "--preset", "tiny", "--blocks", "0"]
    bad = "1=http://10.0.0.6:8471x"
    fails_cleanly(capsys, [*argv, "--peer", bad], "--peer 1=URL 'http://10.0.0.6:8471x' is not")
    assert not state.exists()
