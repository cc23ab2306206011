"""bench/live_attacks.py's reading of its measurements, without a server: latency summaries and
the 2x verdict, the aggregator's checks, the markdown; and the update attackers' bodies
(bench/live_attackers.py builds them without torch) as the aggregator's own checks read them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import live_attackers
import live_attacks
from blocktrain.protocol.core.round_engine import RoundEngine
from live_attacks import Sample
from tests.protocol.conftest import SETTINGS, block_tensors


def samples(kind: str, ms: list[float], outcome: int | str = 200) -> list[Sample]:
    return [Sample(kind, 0.0, x / 1000, outcome) for x in ms]


def test_latency_is_summarised_over_the_served_requests_and_failures_counted() -> None:
    s = live_attacks.summary(samples("status", [1, 2, 3, 4, 5]) + samples("status", [9], 503))
    assert s["n"] == 6 and s["failed"] == 1 and s["outcomes"] == {"200": 5, "503": 1}
    assert s["median_ms"] == pytest.approx(3.0) and s["max_ms"] == pytest.approx(5.0)
    assert s["p90_ms"] == pytest.approx(4.6)  # between the 4th and 5th of 5, interpolated
    assert live_attacks.summary([])["median_ms"] is None


def test_the_verdict_is_the_attacked_median_within_the_factor_and_every_request_served() -> None:
    unloaded = samples("completion", [100, 100, 100])
    ok = live_attacks.honest_entry(unloaded, samples("completion", [150, 200, 250]), 2.0)
    assert ok["ratio"] == pytest.approx(2.0) and ok["within_factor"] and ok["all_served"]
    slow = live_attacks.honest_entry(unloaded, samples("completion", [150, 201, 250]), 2.0)
    assert not slow["within_factor"] and slow["all_served"]
    refused = live_attacks.honest_entry(unloaded, samples("completion", [5, 5], 429), 2.0)
    assert refused["ratio"] is None and not refused["within_factor"]
    assert not refused["all_served"], "a request refused is a failure, however fast"
    cut = live_attacks.honest_entry(unloaded, [Sample("completion", 0, 10, "TimeoutError")], 2)
    assert not cut["all_served"] and cut["loaded"]["outcomes"] == {"TimeoutError": 1}


def workers(accepted: int, late: int) -> dict[str, Any]:
    return {"worker-0": {"accepted": accepted, "late": late, "refused": {}}}


def aggregator_row(**over: Any) -> dict[str, Any]:
    unloaded = samples("status", [4, 4, 4])
    row: dict[str, Any] = {
        "attack": "push_flood",
        "target": "aggregator",
        "deadline_s": 12.0,
        "windows_s": {"unloaded": 25.0, "attack": 30.0},
        "honest": {"status": live_attacks.honest_entry(unloaded, samples("status", [5, 6]), 2.0)},
        "workers": {"unloaded": workers(4, 0), "attack": workers(4, 0)},
        "rounds": {
            "unloaded": {"closed": 8, "median_s": 3.0, "early_before_min_round": 0},
            "attack": {"closed": 7, "median_s": 3.5, "early_before_min_round": 0},
        },
        "rss_mb": {"before": 500.0, "peak": 600.0, "after": 590.0},
        "attacker": {"outcomes": {"push 429 busy": 10}, "cpu_s": 3.0, "seconds": 30.0},
        "server_cpu": {"unloaded": 0.1, "attack": 0.5},
    }
    row.update(over)
    return live_attacks.finish_row(row, 2.0, 256.0)


def test_an_aggregator_row_checks_updates_rounds_and_memory() -> None:
    row = aggregator_row()
    assert row["passed"], row["checks"]
    assert set(row["checks"]) == {
        "status_within_2x",
        "status_all_served",
        "honest_updates_in_time",
        "no_early_round_before_min",
        "rounds_within_2x",
        "rss_bounded",
    }
    late = aggregator_row(workers={"unloaded": workers(4, 0), "attack": workers(3, 1)})
    assert not late["checks"]["honest_updates_in_time"]
    starved = aggregator_row(workers={"unloaded": workers(4, 0), "attack": workers(0, 0)})
    assert not starved["checks"]["honest_updates_in_time"], "30 s is two deadlines: some due"
    short = aggregator_row(
        windows_s={"unloaded": 6.0, "attack": 8.0},
        workers={"unloaded": workers(1, 0), "attack": workers(0, 0)},
    )
    assert short["checks"]["honest_updates_in_time"], "no round need close in 8 s"
    held = aggregator_row(
        rounds={
            "unloaded": {"closed": 8, "median_s": 3.0, "early_before_min_round": 0},
            "attack": {"closed": 2, "median_s": 12.0, "early_before_min_round": 1},
        }
    )
    assert not held["checks"]["rounds_within_2x"]
    assert not held["checks"]["no_early_round_before_min"]
    assert not aggregator_row(rss_mb={"before": 500.0, "peak": 800.0, "after": 800.0})["passed"]


def test_rounds_memory_and_worker_outcomes_are_read_per_window() -> None:
    rounds = [
        {"started_at": 0.0, "closed_at": 3.0, "cause": "all_reported", "accepted": 2},
        {"started_at": 3.0, "closed_at": 15.0, "cause": "deadline", "accepted": 0},
        {"started_at": 15.0, "closed_at": 16.0, "cause": "quorum", "accepted": 1},
    ]
    stats = live_attacks.round_stats(rounds, min_round_s=3.0)
    assert stats["closed"] == 3 and stats["median_s"] == 3.0 and stats["accepted"] == 3
    assert stats["early_before_min_round"] == 1, "the 1 s round closed early on a quorum"
    assert stats["causes"] == {"all_reported": 1, "deadline": 1, "quorum": 1}
    rss = [(0.0, 100.0), (1.0, 110.0), (2.0, 300.0), (3.0, 150.0), (9.0, 140.0)]
    assert live_attacks.rss_stats(rss, 1.5, 3.5, 8.0) == {
        "before": 110.0,
        "peak": 300.0,
        "after": None,
    }
    assert live_attacks.rss_stats(rss, 1.5, 2.5, 10.0)["after"] == 140.0
    updates = [
        {"token_id": 1, "fate": "accepted", "reason": None},
        {"token_id": 1, "fate": "refused", "reason": "late"},
        {"token_id": 2, "fate": "refused", "reason": "no_gain"},
        {"token_id": 9, "fate": "refused", "reason": "busy"},  # an attacker's: not listed
    ]
    got = live_attacks.worker_outcomes(updates, {1: "worker-0", 2: "worker-1"})
    assert got == {
        "worker-0": {"accepted": 1, "late": 1, "refused": {"late": 1}},
        "worker-1": {"accepted": 0, "late": 0, "refused": {"no_gain": 1}},
    }


def test_the_markdown_shows_each_honest_request_and_names_a_failing_check() -> None:
    passing = aggregator_row()
    failing = aggregator_row(
        attack="halfopen",
        honest={
            "status": live_attacks.honest_entry(
                samples("status", [4, 4]), samples("status", [400, 500]), 2.0
            )
        },
    )
    router = live_attacks.finish_row(
        {
            "attack": "unread_streams_4_addresses",
            "target": "router",
            "windows_s": {"unloaded": 25.0, "attack": 30.0},
            "honest": {
                "completion": live_attacks.honest_entry(
                    samples("completion", [200]), samples("completion", [3], 429), 2.0
                )
            },
            "rss_mb": {"before": 300.0, "peak": 300.0, "after": 300.0},
            "attacker": {"outcomes": {"opened": 32}, "cpu_s": 0.3, "seconds": 30.0},
            "server_cpu": {"unloaded": 0.2, "attack": 0.25},
        },
        2.0,
        256.0,
    )
    settings = {
        "quick": False,
        "unloaded_s": 25,
        "attack_s": 30,
        "interval_s": 0.25,
        "deadline_s": 12,
        "local_steps": 5,
        "min_round_s": 3,
        "factor": 2,
        "rss_growth_mb": 256,
    }
    text = live_attacks.markdown(
        {
            "command": "python bench/live_attacks.py",
            "json": "live_attacks.json",
            "settings": settings,
            "rows": [passing, failing, router],
        }
    )
    assert "| push_flood | aggregator | status | 4.0 | 5.5 |" in text
    assert "| 1.38x | 200: 2 | pass |" in text
    assert "| halfopen | aggregator | status | 4.0 | 450 |" in text
    assert "112.50x | 200: 2 | **FAIL**: status_within_2x |" in text
    assert "| unread_streams_4_addresses | router | completion | 200 | — | — | — | 429: 1 |" in text
    assert "**FAIL**: completion_within_2x, completion_all_served |" in text
    assert "| push_flood | worker-0 4 ok, 0 late | worker-0 4 ok, 0 late |" in text
    assert "| 8 (3.0) | 7 (3.5) | 0 | 500 / 600 / 590 |" in text
    assert (
        "| unread_streams_4_addresses | router | 0.0% | 0 | 0.20 → 0.25 | 0.01 | opened: 32 |"
        in text
    )
    assert "| push_flood | aggregator | 100.0% | 0 |" in text
    assert "Aggregator: tiny preset" in text and "Router: 3 block hosts" in text
    small = live_attacks.markdown(
        {
            "command": "python bench/live_attacks.py --preset small",
            "json": "live_attacks-small.json",
            "settings": {**settings, "preset": "small"},
            "rows": [passing],
        }
    )
    assert "Aggregator: small preset" in small and "Router" not in small


def test_the_attackers_bodies_are_what_the_aggregator_reads_them_as() -> None:
    """The update attackers build safetensors by hand (no torch in their process): a noise
    delta of the block's shapes passes every form check; the misshapen and NaN variants of
    quorum_stuffing are refused for their form, before any probe."""
    blocks = {0: block_tensors(100)}
    engine = RoundEngine.fresh(blocks, SETTINGS)
    shapes = {k: list(v.shape) for k, v in blocks[0].items()}
    manifest, data = live_attacks.noise_delta(shapes, "fp16", norm=1.0)
    meta = live_attackers.update_metadata(0, 3, 2, tokens=100, steps=2)
    body = live_attackers.safetensors_body(manifest, data, meta)
    checked = engine.inspect(0, body)
    assert checked.verdict.accepted, checked.verdict
    assert checked.meta is not None and (checked.meta.round, checked.meta.base_version) == (3, 2)
    assert checked.candidate is not None and checked.candidate.norm == pytest.approx(1.0, rel=1e-2)
    bent = live_attackers.safetensors_body(live_attackers.misshapen(manifest), data, meta)
    assert engine.inspect(0, bent).verdict.reason == "bad_shape"
    flat = {"a.bias": torch.zeros(8), "b.weight": torch.zeros(2, 3)}  # the first one 1-D
    flat_engine = RoundEngine.fresh({0: flat}, SETTINGS)
    flat_manifest, flat_data = live_attacks.noise_delta(
        {k: list(v.shape) for k, v in flat.items()}, "fp16", norm=1.0
    )
    bent = live_attackers.safetensors_body(live_attackers.misshapen(flat_manifest), flat_data, meta)
    assert flat_engine.inspect(0, bent).verdict.reason == "bad_shape"
    poisoned = bytearray(data)
    live_attackers.nan(poisoned, "F16")
    refused = engine.inspect(0, live_attackers.safetensors_body(manifest, poisoned, meta))
    assert refused.verdict.reason == "non_finite"


def test_a_stop_string_body_is_about_its_size_and_over_the_router_s_stop_limits() -> None:
    from blocktrain.serving.openai.schemas import MAX_STOP_BYTES, MAX_STOPS

    for many in (True, False):
        body = live_attackers.stop_body("m", 1_000_000, many)
        assert 990_000 < len(body) <= 1_000_100, len(body)
        stops = __import__("json").loads(body)["stop"]
        assert len(stops) > MAX_STOPS or max(len(s) for s in stops) > MAX_STOP_BYTES


def test_rows_run_with_only_replace_their_own_and_keep_the_others(tmp_path: Path) -> None:
    settings = {"quick": False, "attack_s": 30.0}
    measured = aggregator_row()
    old = [
        {
            k: v
            for k, v in measured.items()
            if k not in ("attacker_accepted", "honest_served_share")
        },
        {**measured, "attack": "halfopen", "target": "router", "commit": "a"},
    ]
    path = tmp_path / "live.json"
    path.write_text(json.dumps({"settings": settings, "rows": old, "machine": {"commit": "a"}}))
    new = [{**measured, "commit": "b"}]
    merged = live_attacks.merged_rows(path, new, settings)
    assert [(r["attack"], r["commit"]) for r in merged] == [("push_flood", "b"), ("halfopen", "a")]
    assert "several commits: b: push_flood (aggregator); a: halfopen (router)" in (
        live_attacks._provenance(merged)
    )
    assert all("honest_served_share" in r for r in merged), "old rows get the new figures"
    assert live_attacks.merged_rows(path, new, {**settings, "attack_s": 8.0}) == new
    assert live_attacks.merged_rows(tmp_path / "none.json", new, settings) == new


def test_each_row_says_the_honest_share_served_and_the_attackers_updates_accepted() -> None:
    """Issue 58's two figures: the honest requests served while attacked, of all sent then
    (every kind together), and the attacker's pushes answered 200."""
    flood = aggregator_row(
        honest={
            "status": live_attacks.honest_entry(
                samples("status", [4]),
                samples("status", [5] * 19) + samples("status", [9], 503),
                2.0,
            ),
            "pull": live_attacks.honest_entry(samples("pull", [4]), samples("pull", [5] * 20), 2.0),
        },
        attacker={"outcomes": {"push 200": 6, "push 409 duplicate": 960, "register 200": 3}},
    )
    assert (
        flood["honest_served_share"] == pytest.approx(39 / 40) and flood["attacker_accepted"] == 6
    )
    quiet = aggregator_row(attack="halfopen_4_addresses", attacker={"outcomes": {"opened": 520}})
    assert quiet["attacker_accepted"] == 0 and quiet["honest_served_share"] == 1.0


def test_halfopen_4_addresses_opens_130_from_each_of_four_addresses() -> None:
    argv = live_attacks.aggregator_argv("halfopen_4_addresses", "http://x", 8470, {})
    assert argv[:3] == ["halfopen", "127.0.0.1", "8470"] and "--target" in argv
    assert argv[argv.index("--target") + 1] == "130"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--source"] == [
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.4",
        "127.0.0.5",
    ]
    assert live_attacks.router_argv("halfopen_4_addresses", "http://x", 8100)[-8:] == argv[-8:]
    assert set(live_attacks.TARGETS) == {"aggregator", "router", "host"}
    assert all("halfopen_4_addresses" in a for a in live_attacks.TARGETS.values())


def test_the_halfopen_attacker_keeps_its_target_from_each_source() -> None:
    """`--target` counts per source address: against a listener that never answers, 3 from
    each of 2 addresses stay open (and no more are opened)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # never accepted: the kernel completes the handshakes
    try:
        port = server.getsockname()[1]
        out = live_attackers.halfopen(
            "127.0.0.1", port, ["127.0.0.2", "127.0.0.3"], 0.5, 3, "/v1/status"
        )
    finally:
        server.close()
    assert out["outcomes"] == {"opened": 6} and out["held_at_end"] == 6, out


def test_a_sniffed_body_nudged_by_one_ulp_and_re_stamped_is_refused_as_a_copy() -> None:
    """near_copy's body (issue 58), built without torch: the honest body read back, its first
    value moved by one ulp, its metadata the attacker's; the engine refuses it `copy`."""
    import dataclasses

    blocks = {0: block_tensors(100)}
    engine = RoundEngine.fresh(blocks, dataclasses.replace(SETTINGS, replay_rounds=8))
    ids = iter(range(10))
    honest, thief = (engine.register(0.0, 0, lambda _b: next(ids), t).worker for t in (1, 2))
    for w in (honest, thief):
        engine.pull(w, 0, 0.0)
    shapes = {k: list(v.shape) for k, v in blocks[0].items()}
    manifest, data = live_attacks.noise_delta(shapes, "fp16", norm=1.0, seed=3)
    meta = {**live_attackers.update_metadata(0, 0, 0, tokens=100, steps=2), "worker_id": "0"}
    original = live_attackers.safetensors_body(manifest, data, meta)
    read, raw, got = live_attackers.read_body(original)
    assert (read, raw, got) == (manifest, data, meta), "read_body undoes safetensors_body"
    nudged = live_attackers.one_ulp(raw)
    assert nudged[2:] == raw[2:] and nudged[:2] != raw[:2], "one value, one step"
    for worker, body in ((honest, original), (thief, None)):
        if body is None:
            meta = {**meta, "worker_id": str(worker)}
            body = live_attackers.safetensors_body(read, nudged, meta)
        checked = engine.inspect(0, body)
        assert checked.meta is not None
        verdict = engine.judge(worker, 0, checked.meta, 1.0)
        verdict = engine.screen(worker, 0, checked) if verdict.accepted else verdict
        engine.record(worker, 0, verdict, 1.0, checked=checked)
    assert verdict.reason == "copy", verdict


def test_a_screened_row_counts_the_attackers_accepted_updates_and_the_honest_served() -> None:
    updates = [
        {"id": 1, "token_id": 7, "fate": "accepted", "reason": None},  # its trained original
        {"id": 2, "token_id": 7, "fate": "refused", "reason": "replay"},
        {"id": 3, "token_id": 1, "fate": "accepted", "reason": None},  # an honest worker's
    ]
    got = live_attacks.screened_of(updates, {7}, {"original_update_id": 1})
    assert got == {"attacker_accepted": 0}
    served = samples("status", [4] * 79) + samples("status", [9], 503)
    honest = {"status": live_attacks.honest_entry(samples("status", [4]), served, 2.0)}
    row = aggregator_row(attack="near_replay", honest=honest, **got)
    assert row["honest_served_share"] == pytest.approx(79 / 80)
    assert row["checks"]["no_attacker_update_accepted"] and row["checks"]["honest_served_0.975"]
    refused = samples("status", [4] * 9) + samples("status", [9], 503)
    honest = {"status": live_attacks.honest_entry(samples("status", [4]), refused, 2.0)}
    broken = aggregator_row(attack="noise_probe", honest=honest, attacker_accepted=1)
    assert broken["honest_served_share"] == pytest.approx(0.9)
    assert not broken["checks"]["no_attacker_update_accepted"]
    assert not broken["checks"]["honest_served_0.975"] and not broken["passed"]
    settings = {
        "quick": False, "unloaded_s": 25, "attack_s": 30, "interval_s": 0.25, "deadline_s": 12,
        "local_steps": 5, "min_round_s": 3, "factor": 2, "rss_growth_mb": 256,
    }  # fmt: skip
    text = live_attacks.markdown(
        {"command": "c", "json": "j", "settings": settings, "rows": [row, broken]}
    )
    assert "| near_replay | aggregator | 98.8% | 0 |" in text
    assert "| noise_probe | aggregator | 90.0% | 1 |" in text
