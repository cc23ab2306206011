"""Schemathesis against the aggregator, a block host and the router: a
quick, seeded run of each in the default suite, and one regression test per server error the
fuzzer found. `bench/fuzz.py` runs the same harness at 2,000+ cases per app."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "schemathesis", reason="the fuzz tests need schemathesis (pip install -e .[dev])"
)

from tests.fuzz.bodies import nested, raw_safetensors, split
from tests.fuzz.harness import Target, fuzz, targets
from tests.protocol.conftest import Harness, auth, make_harness

QUICK_CASES = 120


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Target]]:
    with targets(tmp_path_factory.mktemp("fuzz")) as served:
        yield served


@pytest.mark.parametrize("name", ["aggregator", "host", "router"])
def test_quick_fuzz_finds_no_server_error(apps: dict[str, Target], name: str) -> None:
    """Generated and malformed requests, valid tokens and none: every answer is below 500 and
    matches its declared schema (the same seed gives the same cases)."""
    report = fuzz(apps[name], QUICK_CASES, seed_value=12)
    assert report.cases == QUICK_CASES
    assert not report.failures, report.to_json()
    assert max(report.statuses) < 500
    assert len(report.statuses) > 1, "the cases reach more than one outcome"


def test_host_refuses_deeply_nested_header(apps: dict[str, Target]) -> None:
    """Finding "Malformed host messages give 500 (deeply nested JSON, ...)": a message header
    nested past Python's recursion limit is a 400, and the host keeps serving."""
    host = apps["host"]
    header, data = split(host.samples["POST /v1/sweep"])
    header["__metadata__"] = {"blocktrain": nested(100_000)}
    for path in ("/v1/sweep", "/v1/stage"):
        body = raw_safetensors(header, data)
        r = host.client.post(path, content=body, headers=host.valid_headers)
        assert r.status_code == 400, r.text
        assert "nested too deeply" in r.json()["error"]["message"]
    assert host.client.get("/healthz").status_code == 200


def test_host_refuses_non_string_metadata(apps: dict[str, Target]) -> None:
    """Finding "Malformed host messages give 500 (..., non-string metadata)": a 400. (Main's
    `tensorwire.decode` already refuses these; kept so that it stays so.)"""
    host = apps["host"]
    header, data = split(host.samples["POST /v1/sweep"])
    for meta in ({"blocktrain": {"model": "bt"}}, {"blocktrain": 7}, [1, 2]):
        body = raw_safetensors({**header, "__metadata__": meta}, data)
        r = host.client.post("/v1/sweep", content=body, headers=host.valid_headers)
        assert r.status_code == 400, r.text


@pytest.fixture
def agg(tmp_path: Path) -> Iterator[Harness]:
    h = make_harness(tmp_path / "state")
    yield h
    h.state.close()


@pytest.mark.parametrize(
    "request_args",
    [
        ("GET", "/v1/blocks/99999999999999999999", {}),
        ("GET", "/v1/config", {"Content-Length": "99999999999999999999"}),
    ],
    ids=["huge-block-path", "huge-content-length"],
)
def test_absurd_numbers_do_not_break_status(agg: Harness, request_args) -> None:
    """Finding "One request with Content-Length: 99999999999999999999 makes /v1/status and
    /metrics answer 500 until a restart": the number reached the traffic counters, which the
    ledger (64-bit integers) could not store, so every later flush failed. Now refused or
    accounted within range, and status and metrics keep answering."""
    method, path, headers = request_args
    r = agg.client.request(method, path, headers={**auth(agg.alice), **headers})
    assert r.status_code < 500, r.text
    for _ in range(2):
        assert agg.client.get("/v1/status", headers=auth(agg.alice)).status_code == 200
        assert agg.client.get("/metrics").status_code == 200
    agg.service.flush_traffic()  # what the ticker does


def test_out_of_range_worker_id_is_refused(agg: Harness) -> None:
    """Found by the fuzzer: a worker id beyond 64 bits (in the path or X-Worker-Id) reached a
    SQLite query and answered 500; it is an unknown worker (404)."""
    huge = "-23471018416842832084992"
    r = agg.client.delete(f"/v1/workers/{huge}", headers=auth(agg.alice))
    assert r.status_code in (404, 422), r.text
    assert r.json()["accepted"] is False
    r = agg.client.get("/v1/blocks/0", headers={**auth(agg.alice), "X-Worker-Id": huge[1:]})
    assert r.status_code == 404, r.text
    assert r.json()["reason"] == "unknown_worker"


def test_unparseable_json_body_is_a_refusal(agg: Harness) -> None:
    """Found by the fuzzer: a JSON body FastAPI cannot parse was answered in FastAPI's own shape,
    not the declared refusal `{"accepted": false, "reason", "detail"}`."""
    r = agg.client.post(
        "/v1/workers",
        content=b"P\x89\xfb",  # not UTF-8: FastAPI's body parser answers 400 for it
        headers={**auth(agg.alice), "Content-Type": "application/json"},
    )
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["accepted"] is False and body["reason"] == "bad_request"
    assert json.dumps(body)  # plain JSON
