"""`blocktrain simulate`: the JSON contract, the files it writes, and clean errors."""

from __future__ import annotations

import json
from pathlib import Path

from blocktrain.cli.main import main
from tests.cli.test_cli import TINY, fails_cleanly

MICRO = [*TINY, "--local-steps", "2", "--eval-bytes", "256", "--final-bytes", "512"]


def test_json_contract_and_outputs(capsys, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "sim"
    argv = ["simulate", "--workers", "6", "--rounds", "3", "--regime", "lockstep,mild"]
    argv += ["--data", str(corpus), "--out", str(out), "--json", "--seed", "4", *MICRO]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["regimes"]) == {"lockstep", "mild"}
    for result in report["regimes"].values():
        assert {"participation", "initial_ce", "final_ce", "rounds"} <= set(result)
        assert len(result["rounds"]) == 3
        record = result["rounds"][0]
        assert {"round", "time", "participation", "from_noise_ce", "blocks"} <= set(record)
        assert {"accepted", "refused", "expected", "cause"} <= set(record["blocks"][0])
    assert report["config"]["train"]["steps"] == 6  # the schedule spans R x H steps
    assert (out / "ce.png").is_file() and (out / "mild" / "rounds.jsonl").is_file()
    saved = json.loads((out / "simulate.json").read_text())
    assert saved["data"]["path"] == str(corpus.resolve()), "the JSON names its corpus"
    assert saved["regimes"]["lockstep"]["rounds"] == report["regimes"]["lockstep"]["rounds"]
    fails_cleanly(capsys, argv, "already holds a simulation")


def test_eval_every_measures_the_ce_every_k_rounds(capsys, corpus: Path) -> None:
    """--eval-every K: the per-round CE of every K-th round only (the others null), cheaper on a
    long run; the final CE is taken all the same."""
    argv = ["simulate", "--workers", "3", "--rounds", "4", "--regime", "lockstep"]
    assert main([*argv, "--data", str(corpus), "--json", "--eval-every", "2", *MICRO]) == 0
    report = json.loads(capsys.readouterr().out)
    rounds = report["regimes"]["lockstep"]["rounds"]
    assert [r["from_noise_ce"] is not None for r in rounds] == [False, True, False, True]
    assert report["eval"]["every"] == 2 and report["regimes"]["lockstep"]["final_sampler_ce"] > 0


def test_timing_only_table(capsys) -> None:
    argv = ["simulate", "--timing-only", "--rounds", "5", "--regime", "wan", "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("| regime |") and "| wan |" in text


def test_bad_inputs_fail_cleanly(capsys, tmp_path: Path) -> None:
    fails_cleanly(capsys, ["simulate", "--regime", "lockstep,lan", "--timing-only"], "lan")
    fails_cleanly(capsys, ["simulate", "--workers", "2", "--timing-only"], "without a replica")
    (tmp_path / "file").write_text("x")
    argv = ["simulate", "--timing-only", "--out", str(tmp_path / "file")]
    fails_cleanly(capsys, argv, "is a file")
    bad = tmp_path / "r.toml"
    bad.write_text("dropout = 2\n")
    fails_cleanly(capsys, ["simulate", "--regime", str(bad), "--timing-only"], "dropout")


def test_bad_delta_wires_fail_cleanly(capsys) -> None:
    """`--wire topk:0`, `topk:2`, `int9`: one line naming what is accepted, exit 2."""
    for wire in ("topk:0", "topk:2", "int9"):
        argv = ["simulate", "--timing-only", "--rounds", "2", "--wire", wire]
        line = fails_cleanly(capsys, argv, f"delta_wire = '{wire}'")
        assert "topk:RATIO" in line


def test_the_wire_is_reported_and_changes_the_bytes_pushed(capsys) -> None:
    up = {}
    for wire in ("fp16", "topk:0.03"):
        argv = ["simulate", "--timing-only", "--rounds", "2", "--regime", "lockstep"]
        assert main([*argv, "--wire", wire, "--json", "--no-progress"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["protocol"]["delta_wire"] == wire
        sent = report["regimes"]["lockstep"]["bytes"]
        up[wire] = sent["up"] - sent["stream_up"]  # the deltas (relay's streams go as they are)
    assert up["topk:0.03"] < 0.1 * up["fp16"]


def test_slowdown_and_adaptive_pacing(capsys) -> None:
    """`--set slowdown=5:3` makes worker 5 three times slower; `--set pacing=adaptive` tells it fewer
    steps, so that it still gets updates in (issue 30)."""
    argv = ["simulate", "--timing-only", "--rounds", "6", "--regime", "lockstep", "--json"]
    # on the cpu profile tiny's slowest block takes about 0.9 s a round of 8 steps: 1.2 s
    # leaves a normal worker time, not one three times slower
    argv += ["--local-steps", "8", "--deadline", "1.2", "--effect-probe", "off", "--no-progress"]
    argv += ["--set", "slowdown=5:3"]
    slow = {}
    for pacing in ("fixed", "adaptive"):
        assert main([*argv, "--set", f"pacing={pacing}"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["slowdown"] == {"5": 3.0} and report["protocol"]["pacing"] == pacing
        slow[pacing] = report["regimes"]["lockstep"]["workers"][5]
    assert slow["fixed"]["accepted"] == 0 and slow["adaptive"]["accepted"] > 0
    # simulate's own settings (SimSpec's slowdown, attack, unit) by --set: one line, exit 2
    fails_cleanly(capsys, [*argv, "--set", "slowdown=5"], "ID:FACTOR")
    fails_cleanly(capsys, [*argv, "--set", "attack=shrink:x"], "COUNT and BLOCK are integers")
    fails_cleanly(capsys, [*argv, "--set", "unit=blocks"], "choose one of")
