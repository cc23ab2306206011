"""Real processes over real HTTP on loopback: the cluster command, SIGKILL of the aggregator
mid-round, a worker killed mid-round. Marked `network` (they start servers and processes) and
bounded in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from blocktrain.cli.main import main
from blocktrain.errors import Unreachable
from blocktrain.protocol.ops.cluster import BLOCKTRAIN, start_aggregator, start_worker, stop
from blocktrain.protocol.store.storage import StateDir
from blocktrain.protocol.store.tokens import hash_token, new_token
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.retrying import RetryPolicy
from tests.cli.test_log_to import read_events
from tests.conftest import micro_config
from tests.protocol.conftest import run_state

pytestmark = pytest.mark.network

MICRO = ["--set", "d_model=32", "n_heads=2", "seq_len=16", "batch_size=4"]


def wait_for(what: str, check, timeout: float, every: float = 0.1):
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def token(state: StateDir, name: str) -> str:
    t = new_token()
    state.ledger.add_token(name, hash_token(t), time.time())
    return t


@pytest.mark.timeout(180)
def cluster_argv(out, corpus, *settings: str) -> list[str]:
    return [
        "cluster",
        "--workers",
        "3",
        "--preset",
        "tiny",
        *MICRO,
        *settings,
        "--rounds",
        "3",
        "--local-steps",
        "2",
        "--deadline",
        "30",
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--eval-bytes",
        "256",
        "--final-bytes",
        "256",
        "--final-sweeps",
        "2",
        "--no-progress",
        "--json",
        "--set",
        "round_eval_sweeps=1",
    ]


def test_a_features_cluster_trains_over_http(tmp_path, corpus, capsys):
    """route = features over HTTP: the workers of blocks 1 and 2 read the blocks before theirs
    each round, every update lands, and the exported model evaluates."""
    out = tmp_path / "cluster"
    assert main(cluster_argv(out, corpus, "route=features")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"]["accepted"] == 9 and summary["updates"]["refused"] == 0
    assert summary["per_round_eval"]["sweeps"] == 1  # --set round_eval_sweeps
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    capsys.readouterr()
    argv = ["eval", str(out / "model"), "--data", str(corpus), "--bytes", "64", "--sweeps", "1"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sampler_ce"] < 5.545  # below uniform bytes


def test_a_relay_cluster_trains_over_http(tmp_path, corpus, capsys):
    """route = relay, the default, over HTTP: the workers of blocks 1 and 2 train on the
    streams the workers before them relay through the aggregator, every update lands, and the
    exported model evaluates."""
    out = tmp_path / "cluster"
    assert main(cluster_argv(out, corpus, "route=relay")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"]["accepted"] == 9 and summary["updates"]["refused"] == 0
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    capsys.readouterr()
    argv = ["eval", str(out / "model"), "--data", str(corpus), "--bytes", "64", "--sweeps", "1"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sampler_ce"] < 5.545  # below uniform bytes


def test_a_diloco_cluster_trains_over_http(tmp_path, corpus, capsys):
    """--reference: every worker trains a replica of the end-to-end model (DiLoCo, outer
    Nesterov; the cluster turns the effect probe off, and refuses it asked for), the state
    exports as a reference run, and the aggregator refuses the probe."""
    out = tmp_path / "cluster"
    argv = cluster_argv(out, corpus, "blocks=1", "layers=2")
    assert main([*argv, "--reference", "--effect-probe", "on"]) == 2
    assert "--effect-probe off" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--reference", "--outer-lr", "0.7", "--outer-momentum", "0.9"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["unit"] == "reference" and summary["blocks"] == 1
    assert summary["replicas_per_block"] == [3]
    # a round closes once the replicas that pulled it report: a late starter joins later
    assert [r["round"] for r in summary["participation"]["0"]] == [0, 1, 2]
    assert summary["updates"]["accepted"] >= 3 and summary["updates"]["refused"] == 0
    assert summary["from_noise_ce_per_round"][-1] < summary["from_noise_ce_per_round"][0]
    capsys.readouterr()
    exported = tmp_path / "exported"
    assert main(["export", "--state", str(out / "state"), "--out", str(exported)]) == 0
    capsys.readouterr()
    for run in (out / "model", exported):
        assert main(["eval", str(run), "--data", str(corpus), "--bytes", "64", "--json"]) == 0
        assert "ce" in json.loads(capsys.readouterr().out)  # a reference's exact CE
    state = tmp_path / "state"
    code = main(["aggregator", "--state", str(state), "--preset", "tiny", "--reference"])
    assert code == 2 and "--effect-probe off" in capsys.readouterr().err
    assert not state.exists()


def test_cluster_command_runs_rounds_over_http(tmp_path, corpus, capsys):
    out = tmp_path / "cluster"
    code = main([*cluster_argv(out, corpus), "--log-to", "tensorboard"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(capsys.readouterr().out)
    assert len(summary["from_noise_ce_per_round"]) == 4, "round 0 (init) and after each round"
    # the live evaluation, on in a cluster (--set live_eval_every=1): the models after 0 and 3
    # rounds at least (one that found another waiting may be skipped), while the rounds ran
    state = StateDir(out / "state")
    live = state.evals()
    state.close()
    assert {0, 3} <= {r["rounds"] for r in live} <= {0, 1, 2, 3}, live
    assert live[0]["from_noise_ce"] == pytest.approx(summary["from_noise_ce_per_round"][0], abs=0.1)
    assert summary["replicas_per_block"] == [1, 1, 1] or summary["workers"] == 3
    for b in ("0", "1", "2"):
        rounds = summary["participation"][b]
        assert [r["round"] for r in rounds] == [0, 1, 2]
        assert all(r["accepted"] == 1 for r in rounds), rounds
    assert summary["updates"]["accepted"] == 9 and summary["updates"]["refused"] == 0
    assert (summary["effect_probe"], summary["pull_wire"]) == ("on", "full")  # the defaults
    b = summary["bytes"]
    # the minimum (a pull and a push per worker-round) leaves out route = features' upstream
    # reads: at most one of each block before the worker's own per round, 0 + 1 + 2 reads
    # against 3 pulls and 3 pushes, and fewer where an upstream block has not moved since
    assert b["worker_rounds"] == 9 and 1.0 <= b["ratio_to_minimum"] < 1.55, b
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    assert (out / "model" / "model.safetensors").is_file()
    # the model records its corpus as a train run does, and the summary names it (issue 30)
    record = json.loads((out / "model" / "data.json").read_text())
    assert record["path"] == str(corpus.resolve()) and summary["data"] == record
    # --log-to: the committed rounds and the evaluations, at step = the rounds done
    tags, _ = read_events(out / "tensorboard")
    for b in ("0", "1", "2"):
        rows = summary["participation"][b]
        assert tags[f"rounds/block{b}/accepted"] == [(r["round"] + 1, 1.0) for r in rows]
        assert [s for s, _ in tags[f"rounds/block{b}/loss"]] == [1, 2, 3]
    assert [v for _, v in tags["valid/from_noise_ce"]] == pytest.approx(
        summary["from_noise_ce_per_round"]
    )
    assert tags["final/sampler_ce"] == [(3, pytest.approx(summary["final"]["sampler_ce"]))]
    assert (
        main(["eval", str(out / "model"), "--data", str(corpus), "--bytes", "64", "--sweeps", "1"])
        == 0
    )


@pytest.mark.timeout(240)
def test_cluster_prints_its_dashboard_and_keeps_it_up_through_the_evaluation(
    tmp_path, corpus, capsys, monkeypatch
):
    """Issue 30: `cluster` printed no URL, its tokens were stored only as hashes, the
    evaluation after the rounds was silent for minutes, and the workers that had exited stayed
    `live`. It now prints the dashboard's URL with a viewer token, the aggregator answers until
    the evaluation ends, the evaluation says what it does, and the status shows the run done and
    every worker left."""
    from blocktrain.cli import cluster_eval

    out = tmp_path / "cluster"
    seen: dict[str, object] = {}
    evaluate = cluster_eval.evaluate_units

    def watched(*args, **kwargs):
        if "status" not in seen:  # the first evaluation: the rounds are over
            url = json.loads((out / "state" / "endpoint.json").read_text())["url"]
            viewer = (out / "viewer.token").read_text().strip()
            headers = {"Authorization": f"Bearer {viewer}"}
            seen["status"] = httpx.get(f"{url}/v1/status", headers=headers).json()
            seen["dashboard"] = httpx.get(f"{url}/dashboard").status_code
            seen["register"] = httpx.post(f"{url}/v1/workers", json={}, headers=headers).json()
            seen["url"] = url
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(cluster_eval, "evaluate_units", watched)
    argv = [a for a in cluster_argv(out, corpus) if a != "--no-progress"]  # stderr: no terminal
    assert main(argv) == 0
    err = capsys.readouterr().err
    url = str(seen["url"])
    viewer = (out / "viewer.token").read_text().strip()
    assert (out / "viewer.token").stat().st_mode & 0o777 == 0o600
    assert f"cluster: dashboard {url}/dashboard#token={viewer}\n" in err
    assert f"cluster: viewer token {viewer} (in {out / 'viewer.token'}; it may only watch" in err
    assert "cluster: evaluating 4 models" in err and "the dashboard stays up" in err
    assert "cluster: after round 3 of 3: from-noise CE " in err
    assert "cluster: final evaluation of " in err
    status = seen["status"]
    assert seen["dashboard"] == 200 and status["done"] is True
    assert [w["state"] for w in status["workers"]["list"]] == ["left"] * 3
    assert status["workers"]["live"] == 0
    assert seen["register"]["reason"] == "viewer_token", "the printed token may only watch"
    with pytest.raises(httpx.TransportError):  # the evaluation is over: so is the aggregator
        httpx.get(f"{url}/dashboard", timeout=2.0)
    summary = json.loads((out / "summary.json").read_text())
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    for i in range(3):  # each worker's log says what each of its rounds did
        log = (out / "logs" / f"worker-{i}.log").read_text()
        assert log.count("; accepted\n") == 3, log


@pytest.mark.timeout(240)
def test_keep_dashboard_keeps_the_aggregator_up_until_ctrl_c(tmp_path, corpus):
    out = tmp_path / "cluster"
    argv = [a for a in cluster_argv(out, corpus) if a != "--json"]
    proc = subprocess.Popen(
        [*BLOCKTRAIN, *argv, "--keep-dashboard"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        lines: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "until Ctrl-C" in line:
                break
        dashboard = next(x for x in lines if x.startswith("cluster: dashboard "))
        page = dashboard.split()[2]
        url, _, fragment = page.partition("/dashboard#token=")
        assert httpx.get(f"{url}/dashboard").status_code == 200
        time.sleep(1.0)  # still up after the summary was written
        status = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {fragment}"})
        assert status.status_code == 200 and status.json()["done"] is True
        assert json.loads((out / "summary.json").read_text())["exit_codes"]["aggregator"] is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert proc.stdout is not None and "cluster of 3 workers: 3 rounds" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/dashboard", timeout=2.0)
    summary = json.loads((out / "summary.json").read_text())
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_the_aggregator_mid_round_loses_no_accepted_update(tmp_path, corpus):
    state = run_state(tmp_path / "state", micro_config(), {"deadline_s": 8.0, "local_steps": 2})
    workers_tokens = [token(state, f"w{i}") for i in range(2)]
    probe_token = token(state, "probe")
    logs = tmp_path / "logs"
    agg, url = start_aggregator(state, logs)
    port = int(url.rsplit(":", 1)[1])
    procs = [agg]
    probe = AggregatorClient(url, probe_token, retry=RetryPolicy(give_up_after_s=30))
    try:
        for i, t in enumerate(workers_tokens):
            procs.append(
                start_worker(
                    url, t, logs, name=f"worker-{i}", data=str(corpus), extra=["--block", "0"]
                )
            )
        wait_for("two rounds", lambda: probe.status()["rounds"][0] >= 2, 90)
        # hold the open round until its deadline: the probe pulls it and never pushes
        probe.register(block=0)
        pulled = probe.pull(0)
        held = pulled.round
        wait_for(
            "both workers' updates in the held round",
            lambda: (
                probe.status()["blocks"][0]["pending_accepted"] == 2
                and probe.status()["rounds"][0] == held
            ),
            30,
        )
        before = probe.status()
        assert before["versions"][0] == pulled.version
        agg.popen.send_signal(signal.SIGKILL)
        agg.popen.wait(timeout=10)
        accepted_before = {u.id for u in state.ledger.updates(fate="accepted")}
        open_before = {u.id for u in state.ledger.open_accepted(0)}
        assert len(open_before) == 2, "the held round's two accepted updates are in the ledger"
        killed_at = time.time()

        agg2, url2 = start_aggregator(state, logs, port=port, name="aggregator-2")
        procs.append(agg2)
        assert url2 == url
        after = probe.status()
        assert after["versions"][0] == before["versions"][0] or after["rounds"][0] > held, (
            "resumed from the last committed version"
        )
        wait_for(
            "the held round to commit with its updates",
            lambda: all(
                u.committed_version is not None
                for u in state.ledger.updates(fate="accepted")
                if u.id in open_before
            ),
            30,
        )
        # the workers come back by themselves: new accepted updates from both
        wait_for(
            "both workers back",
            lambda: (
                {
                    u.worker_id
                    for u in state.ledger.updates(fate="accepted")
                    if u.received > killed_at and u.round is not None and u.round > held
                }
                == {0, 1}
            ),
            60,
        )
        ledger = state.ledger
        lost = [
            u.id
            for u in ledger.updates(fate="accepted")
            if u.id in accepted_before and u.committed_version is None
        ]
        assert lost == [], "every update accepted before the kill went into a version"
        row = next(r for r in ledger.rounds(0) if r["round"] == held)
        assert row["accepted"] == 2 and row["new_version"] == pulled.version + 1
    finally:
        probe.close()
        stop(procs[1:] + [p for p in procs[:1]])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_worker_stalls_its_block_for_at_most_one_deadline(tmp_path, corpus):
    deadline = 5.0
    state = run_state(
        tmp_path / "state", micro_config(), {"deadline_s": deadline, "local_steps": 2}
    )
    tokens = [token(state, f"w{i}") for i in range(2)]
    observer = token(state, "observer")
    logs = tmp_path / "logs"
    agg, url = start_aggregator(state, logs)
    procs = [agg]
    client = AggregatorClient(url, observer, retry=RetryPolicy(give_up_after_s=30))
    try:
        for i, t in enumerate(tokens):
            procs.append(
                start_worker(
                    url, t, logs, name=f"worker-{i}", data=str(corpus), extra=["--block", "0"]
                )
            )
        wait_for("rounds with both workers", lambda: client.status()["rounds"][0] >= 3, 90)
        procs[1].popen.send_signal(signal.SIGKILL)
        killed_round = client.status()["rounds"][0]
        wait_for("four more rounds", lambda: client.status()["rounds"][0] >= killed_round + 4, 60)
        rounds = [r for r in state.ledger.rounds(0) if r["round"] >= killed_round]
        by_deadline = [r["round"] for r in rounds if r["cause"] == "deadline"]
        assert len(by_deadline) <= 1, f"rounds closed by the deadline: {by_deadline}"
        stalled = sum(r["closed_at"] - r["started_at"] for r in rounds[:4])
        assert stalled < deadline + 4 * 2.0, f"{stalled:.1f}s for four rounds"
        assert all(r["accepted"] >= 1 for r in rounds[1:4]), "the survivor keeps training"
    finally:
        client.close()
        stop(procs[1:] + procs[:1])


@pytest.mark.timeout(120)
def test_tls_and_a_clean_stop_on_sigterm(tmp_path, corpus, capsys):
    """HTTPS with a self-signed certificate; a worker stopped by SIGTERM says goodbye, exits 0
    and the block stops waiting for it."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    assert main(["tls", "self-signed", "--out", str(tmp_path / "tls")]) == 0  # the one command
    cert, key = tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem"
    state = run_state(tmp_path / "state", micro_config(), {"deadline_s": 20.0, "local_steps": 2})
    worker_token, observer = token(state, "w"), token(state, "observer")
    logs = tmp_path / "logs"
    agg, url = start_aggregator(state, logs, extra=["--tls-cert", str(cert), "--tls-key", str(key)])
    procs = [agg]
    assert url.startswith("https://127.0.0.1:")
    client = AggregatorClient(
        url, observer, verify=str(cert), retry=RetryPolicy(give_up_after_s=30)
    )
    try:
        worker = start_worker(
            url,
            worker_token,
            logs,
            name="worker",
            data=str(corpus),
            extra=["--ca-cert", str(cert), "--block", "0"],  # block 1 waits for its relay
        )
        procs.append(worker)
        wait_for("a few rounds over TLS", lambda: client.status()["rounds"][0] >= 2, 90)
        worker.popen.send_signal(signal.SIGTERM)
        assert worker.popen.wait(timeout=30) == 0, worker.stderr.read_text()[-500:]
        report = json.loads(worker.stdout.read_text())
        assert report["stopped_by"] == "signal" and report["accepted"] >= 2
        status = client.status()
        assert status["blocks"][0]["assigned"] == [], "the worker left"
        (tmp_path / "observer.token").write_text(observer)
        status_argv = ["status", url, "--token-file", str(tmp_path / "observer.token")]
        assert main([*status_argv, "--ca-file", str(cert)]) == 0
        assert "block 0: round" in capsys.readouterr().out
        plain = AggregatorClient(url, observer, retry=RetryPolicy(give_up_after_s=0.5))
        with pytest.raises(Unreachable, match=r"CERTIFICATE_VERIFY_FAILED"):
            plain.status()  # an unknown certificate is not trusted by default
        plain.close()
    finally:
        client.close()
        stop(procs[1:] + procs[:1])
