"""`blocktrain worker` says what each round did, on stderr: the round, its local steps, bytes/s,
the loss and the verdict, and a hint when the update came late (issue 30: a worker's log stayed
empty for ten minutes, then printed `12 rounds, 7 accepted, refused {'late': 5}`)."""

from __future__ import annotations

import re
import signal
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from blocktrain.cli import worker
from blocktrain.cli.main import main
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.protocol.worker import loop
from blocktrain.protocol.worker.client import AggregatorClient
from tests.asgi import answered_by
from tests.cli.test_cli import fails_cleanly
from tests.cli.test_log_to import read_events
from tests.conftest import micro_config
from tests.protocol.conftest import FakeClock, run_state

DEADLINE = 30.0


@pytest.fixture
def aggregator(tmp_path, monkeypatch):
    """An aggregator app in this process that the worker command reaches as http://agg; the
    second push (round 1's) reaches it after the round's deadline."""
    settings = {"deadline_s": DEADLINE, "local_steps": 2, "min_round_s": 0.0}
    state = run_state(tmp_path / "state", micro_config(), settings)
    token = new_token()
    state.ledger.add_token("alice", hash_token(token), 0.0)
    clock = FakeClock()
    app = TestClient(create_app(storage=state, clock=clock), base_url="http://agg")
    app.__enter__()  # one event loop for every request (the long poll's events live in it)

    pushes = [0]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("/updates"):
            pushes[0] += 1
            if pushes[0] == 2:  # round 1's update misses its deadline
                clock.advance(DEADLINE + 1)
        return answered_by(app, request)

    def client(url, token, **kwargs):
        return AggregatorClient(
            url, token, transport=httpx.MockTransport(handler), stop=kwargs["stop"]
        )

    monkeypatch.setattr(worker, "AggregatorClient", client)
    # the worker's own clock sees the aggregator's jump too, as a slow round would show it
    real = time.monotonic
    fake_time = SimpleNamespace(monotonic=lambda: real() + clock.now)
    monkeypatch.setattr(loop, "time", fake_time, raising=False)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # leave pytest's handlers be
    monkeypatch.setenv("BLOCKTRAIN_TOKEN", token)
    yield state
    app.__exit__(None, None, None)
    state.close()


def argv(corpus, *extra: str) -> list[str]:
    return [
        "worker", "--aggregator", "http://agg", "--data", str(corpus), "--block", "0",
        "--max-rounds", "2", *extra,
    ]  # fmt: skip


def test_the_worker_prints_a_line_per_round_and_a_hint(aggregator, corpus, capsys):
    assert main(argv(corpus)) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("worker 0 (block 0): 2 rounds, 1 accepted, refused {'late': 1}")
    err = captured.err.splitlines()
    assert err[0].startswith("worker 0 on block 0 (data seed ") and "H = 2" in err[0]
    line = r"round {} \(block 0\): 2 steps in \d+\.\d+s, [\d,]+ bytes/s, loss \d+\.\d{{3}}; "
    assert re.fullmatch(line.format(0) + "accepted", err[1]), err
    assert re.fullmatch(line.format(1) + r"refused: late \(.+\)", err[2]), err
    assert err[3].startswith("  hint: updates arrive after the round's deadline")
    assert err[3].endswith(
        "raise the aggregator's --deadline or lower its --local-steps, or run it with "
        "--set pacing=adaptive"
    )
    assert err[-1] == (
        "1 of 2 updates came late: raise the aggregator's --deadline or lower its --local-steps"
    )


def test_quiet_keeps_only_the_report(aggregator, corpus, capsys):
    assert main(argv(corpus, "--quiet")) == 0
    captured = capsys.readouterr()
    assert "2 rounds, 1 accepted" in captured.out
    assert "round " not in captured.err and "hint" not in captured.err, captured.err


def test_log_to_tensorboard_gets_each_rounds_line(aggregator, corpus, tmp_path, capsys):
    """Issue 30, experiment logging: `worker --log-to tensorboard` logs what each round's line
    says, at step = the round: its steps, bytes/s, loss and verdict."""
    logs = tmp_path / "logs"
    assert main(argv(corpus, "--log-to", "tensorboard", "--state", str(logs))) == 0
    err = capsys.readouterr().err
    printed = re.findall(
        r"^round (\d) \(block 0\): (\d) steps in .*, loss (\d+\.\d{3}); ", err, re.M
    )
    assert [r for r, _, _ in printed] == ["0", "1"], err
    tags, purges = read_events(logs / "tensorboard")
    assert [s for s, _ in tags["worker/loss"]] == [0, 1] and not purges
    assert [v for _, v in tags["worker/loss"]] == pytest.approx(
        [float(loss) for _, _, loss in printed], abs=6e-4
    )
    assert [v for _, v in tags["worker/steps"]] == [float(n) for _, n, _ in printed]
    assert [v for _, v in tags["worker/accepted"]] == [1.0, 0.0]
    assert tags["worker/refused/late"] == [(1, 1.0)] and tags["worker/late"][1] == (1, 1.0)
    assert [s for s, _ in tags["worker/bytes_per_s"]] == [0, 1]


def test_log_to_needs_a_folder(aggregator, corpus, capsys):
    fails_cleanly(capsys, argv(corpus, "--log-to", "tensorboard"), "give --state DIR")
    fails_cleanly(capsys, argv(corpus, "--log-to", "comet", "--state", "x"), "choose from")
