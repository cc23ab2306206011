"""`blocktrain worker --state DIR` (issue 30, "a worker that resumes"): a worker started again
with its folder says it resumed and comes back as the same worker; a folder of another block
or run is refused with one line (exit 2) and left as it was; `--fresh` starts a new worker.
Before, a restarted worker always came back as a new one (a new id, a new data seed)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from blocktrain.cli import worker
from blocktrain.cli.main import main
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.protocol.worker.client import AggregatorClient
from tests.asgi import answered_by
from tests.cli.test_log_to import read_events
from tests.conftest import micro_config
from tests.protocol.conftest import FakeClock, run_state


@pytest.fixture
def aggregator(tmp_path, monkeypatch):
    """A run's aggregator in this process, reached by the worker command as http://agg."""
    settings = {"deadline_s": 30.0, "local_steps": 2, "min_round_s": 0.0, "max_rounds": 4}
    state = run_state(tmp_path / "state", micro_config("features"), settings)
    token = new_token()
    state.ledger.add_token("alice", hash_token(token), 0.0)
    app = TestClient(create_app(storage=state, clock=FakeClock()), base_url="http://agg")
    app.__enter__()

    def handler(request: httpx.Request) -> httpx.Response:
        return answered_by(app, request)

    def client(url, token, **kwargs):
        return AggregatorClient(
            url, token, transport=httpx.MockTransport(handler), stop=kwargs["stop"]
        )

    monkeypatch.setattr(worker, "AggregatorClient", client)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setenv("BLOCKTRAIN_TOKEN", token)
    yield state
    app.__exit__(None, None, None)
    state.close()


def argv(corpus: Path, folder: Path, *extra: str) -> list[str]:
    return [
        "worker", "--aggregator", "http://agg", "--data", str(corpus), "--state", str(folder),
        "--max-rounds", "1", *extra,
    ]  # fmt: skip


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_a_worker_started_again_with_its_folder_resumes(aggregator, corpus, tmp_path, capsys):
    folder = tmp_path / "w"
    assert main(argv(corpus, folder, "--block", "1")) == 0
    first = capsys.readouterr()
    assert first.out.startswith("worker 0 (block 1): 1 rounds, 1 accepted")
    assert "resumed" not in first.err
    saved = json.loads((folder / "worker.json").read_text())
    assert (saved["worker_id"], saved["block"], saved["round"]) == (0, 1, 0)

    assert main(argv(corpus, folder)) == 0  # no --block: the folder's
    again = capsys.readouterr()
    err = again.err.splitlines()
    assert (
        err[0] == f"worker 0 on block 1 (data seed {saved['data_seed']}, H = 2 local steps a round)"
    )
    assert err[1] == f"resumed worker 0 from {folder}: after round 0, AdamW state of 2 local steps"
    assert err[2].startswith("round 1 (block 1): 2 steps in ")
    assert again.out.startswith("worker 0 (block 1): 1 rounds, 1 accepted")
    assert [w.id for w in aggregator.ledger.workers(active_only=False)] == [0]
    assert json.loads((folder / "worker.json").read_text())["round"] == 1


def test_a_folder_of_another_block_or_run_is_refused(aggregator, corpus, tmp_path, capsys):
    folder = tmp_path / "w"
    assert main(argv(corpus, folder, "--block", "0")) == 0
    capsys.readouterr()
    before = files(folder)

    assert main(argv(corpus, folder, "--block", "1")) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"blocktrain: error: {folder} holds worker 0 of block 0, not block 1: drop --block to "
        "resume it, or give another --state, or add --fresh to start a new worker there"
    )
    assert files(folder) == before

    # a folder another run wrote (its aggregator's run id is not this one's)
    doc = json.loads((folder / "worker.json").read_text())
    (folder / "worker.json").write_text(json.dumps({**doc, "run_id": "0" * 32}))
    before = files(folder)
    assert main(argv(corpus, folder)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"blocktrain: error: {folder} belongs to another run (run 0000")
    assert line.endswith("give another --state, or add --fresh to start a new worker there")
    assert files(folder) == before, "nothing written"
    assert len(aggregator.ledger.workers(active_only=False)) == 1, "nothing registered"

    # --fresh: a new worker, and the folder is its
    assert main(argv(corpus, folder, "--fresh")) == 0
    out = capsys.readouterr()
    assert out.err.startswith("worker 1 on block ") and "resumed" not in out.err
    assert json.loads((folder / "worker.json").read_text())["worker_id"] == 1


def test_fresh_needs_a_folder(aggregator, corpus, capsys):
    args = ["worker", "--aggregator", "http://agg", "--data", str(corpus), "--fresh"]
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "blocktrain: error: --fresh discards the worker of a --state folder: give --state DIR\n"
    )


def test_the_flags_are_in_the_help_of_worker_and_join(capsys):
    for command in ("worker", "join"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--state DIR the worker's own folder" in text and "--fresh" in text


def test_a_resumed_worker_logs_on_in_its_folder(aggregator, corpus, tmp_path, capsys):
    """`--log-to` writes in the --state folder, which a resume still takes,
    and the resumed worker's rounds follow the first one's (what was logged after the round it
    resumes from is dropped, as `train --resume` does)."""
    folder = tmp_path / "w"
    assert main(argv(corpus, folder, "--log-to", "tensorboard")) == 0
    assert main(argv(corpus, folder, "--log-to", "tensorboard")) == 0
    assert "resumed worker 0" in capsys.readouterr().err
    tags, purges = read_events(folder / "tensorboard")
    assert [s for s, _ in tags["worker/loss"]] == [0, 1] and purges == [1]
    assert [v for _, v in tags["worker/accepted"]] == [1.0, 1.0]


def test_a_worker_that_trains_no_round_writes_no_logs(aggregator, corpus, tmp_path, capsys):
    """The loggers open at the first round: a worker stopped before it (here: the run is
    done) leaves its registration in its folder, and no logs."""
    folder = tmp_path / "w"
    for _ in range(4):  # the run's four rounds of block 0, by another worker
        assert main(argv(corpus, tmp_path / "other", "--block", "0")) == 0
    capsys.readouterr()
    extra = ("--block", "0", "--log-to", "tensorboard")
    assert main(argv(corpus, folder, *extra)) == 0
    assert "stopped by done" in capsys.readouterr().out
    assert [p.name for p in folder.iterdir()] == ["worker.json"]
