"""Pulls through a plain HTTP cache or CDN: committed versions at immutable URLs with a strong
ETag (304 on If-None-Match), byte ranges (206, 416), a 303 from the round's pull to them, the
token check unless the weights are public, and versions pruned by keep_versions gone (410)."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from fastapi.testclient import TestClient

from blocktrain.protocol.core.bodies import decode
from blocktrain.protocol.http.app import create_app
from blocktrain.protocol.http.weights import byte_range, etag_matches
from blocktrain.protocol.service.access import AccessLimits
from blocktrain.protocol.worker.client import AggregatorClient
from tests.protocol.conftest import SETTINGS, Harness, auth, delta_body, make_harness

URL = "/v1/blocks/0/versions/0"


def fetch(h: Harness, url: str = URL, token: str | None = "alice", **headers: str):
    base = {} if token is None else auth(getattr(h, token))
    return h.client.get(url, headers={**base, **headers})


def test_a_version_is_immutable_with_a_strong_etag(harness):
    r = fetch(harness)
    assert r.status_code == 200
    assert r.headers["cache-control"] == "private, max-age=31536000, immutable"
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["etag"] == f'"{hashlib.sha256(r.content).hexdigest()}"'
    decoded = decode(r.content)
    assert decoded.metadata["version"] == "0" and "round" not in decoded.metadata
    for name, t in decoded.to_torch().items():
        torch.testing.assert_close(t.float(), harness.weights(0)[name], atol=2e-3, rtol=1e-3)
    assert fetch(harness).content == r.content  # the same bytes every time


def test_if_none_match_answers_304_without_a_body(harness):
    etag = fetch(harness).headers["etag"]
    for header in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        r = fetch(harness, **{"If-None-Match": header})
        assert r.status_code == 304 and r.content == b"", header
        assert r.headers["etag"] == etag
    assert fetch(harness, **{"If-None-Match": '"other"'}).status_code == 200


def test_ranges_206_and_416(harness):
    whole = fetch(harness).content
    size = len(whole)
    r = fetch(harness, Range="bytes=0-99")
    assert r.status_code == 206 and r.content == whole[:100]
    assert r.headers["content-range"] == f"bytes 0-99/{size}"
    assert fetch(harness, Range="bytes=-10").content == whole[-10:]
    assert fetch(harness, Range=f"bytes=100-{size + 50}").content == whole[100:]
    # several ranges, another unit, or a stale If-Range: the whole body
    assert fetch(harness, Range="bytes=0-1,5-6").content == whole
    assert fetch(harness, Range="items=0-1").status_code == 200
    stale = fetch(harness, Range="bytes=0-9", **{"If-Range": '"old"'})
    assert stale.status_code == 200 and stale.content == whole
    bad = fetch(harness, Range=f"bytes={size}-")
    assert bad.status_code == 416 and bad.json()["reason"] == "bad_range"
    assert bad.headers["content-range"] == f"bytes */{size}"


def test_byte_range_parsing():
    assert byte_range(None, 10) is None
    assert byte_range("bytes=2-4", 10) == (2, 5)
    assert byte_range("bytes=2-", 10) == (2, 10)
    assert byte_range("bytes=-3", 10) == (7, 10)
    assert byte_range("bytes=-30", 10) == (0, 10)
    assert byte_range("bytes=5-2", 10) is None  # invalid: ignored
    assert byte_range("bytes=-", 10) is None
    assert etag_matches('"a", "b"', '"b"') and not etag_matches(None, '"b"')


def test_the_token_is_checked_unless_the_weights_are_public(harness, tmp_path):
    r = fetch(harness, token=None)
    assert r.status_code == 401 and r.json()["reason"] == "missing_token"
    app = create_app(
        storage=harness.state, clock=harness.clock, limits=AccessLimits(public_weights=True)
    )
    public = TestClient(app, base_url="http://agg").get(URL)
    assert public.status_code == 200
    assert public.headers["cache-control"] == "public, max-age=31536000, immutable"


def test_pull_redirects_to_the_version_and_still_records_the_pull(harness):
    w = harness.register(harness.alice, block=0)["worker_id"]
    r = harness.client.get(
        "/v1/blocks/0", params={"redirect": 1}, headers=auth(harness.alice, w),
        follow_redirects=False,
    )  # fmt: skip
    assert r.status_code == 303 and r.headers["location"] == URL
    assert r.headers["x-round"] == "0" and r.headers["cache-control"] == "no-store"
    assert r.headers["x-deadline-in"] != ""  # the round's clock started
    plain = harness.pull(harness.alice, w, 0)  # the old pull: the body, and where it lives
    assert plain.status_code == 200 and plain.headers["x-weights-url"] == URL
    assert decode(plain.content).metadata["round"] == "0"


def test_pruned_and_future_versions(tmp_path):
    h = make_harness(tmp_path / "s", SETTINGS.replace(keep_versions=1))
    w = h.register(h.alice, block=0)["worker_id"]
    for version in range(2):  # one replica: each push closes a round, a new version
        h.pull(h.alice, w, 0)
        r = h.push(h.alice, w, 0, delta_body(0, base_version=version, round=version, worker=w))
        assert r.status_code == 200, r.text
    assert fetch(h, "/v1/blocks/0/versions/2").status_code == 200
    gone = fetch(h, "/v1/blocks/0/versions/1")
    assert gone.status_code == 410 and gone.json()["reason"] == "version_gone"
    assert fetch(h, "/v1/blocks/0/versions/0").status_code == 200  # version 0 is kept
    future = fetch(h, "/v1/blocks/0/versions/3")
    assert future.status_code == 404 and future.json()["reason"] == "unknown_version"
    assert fetch(h, "/v1/blocks/9/versions/0").json()["reason"] == "unknown_block"
    h.state.close()


def test_the_worker_client_pulls_through_the_versioned_url_and_revalidates(harness):
    statuses: list[tuple[str, int]] = []
    harness.client.event_hooks["response"].append(
        lambda r: statuses.append((r.request.url.path, r.status_code))
    )
    c = AggregatorClient("http://agg", harness.alice, client=harness.client, rng=random.Random(0))
    c.register(block=0)
    first = c.pull(0)
    assert (first.round, first.version) == (0, 0)
    assert ("/v1/blocks/0", 303) in statuses and (URL, 200) in statuses
    again = c.pull(0)  # the same version: revalidated, not downloaded
    assert statuses[-1] == (URL, 304)
    for name, t in again.tensors.items():
        torch.testing.assert_close(t, first.tensors[name])
    again.tensors["embed"].add_(1.0)  # the held copy is the client's own
    third = c.pull(0)
    torch.testing.assert_close(third.tensors["embed"], first.tensors["embed"])


@pytest.mark.parametrize("header", ["bytes=0-0", "bytes=-1"])
def test_a_one_byte_range(harness, header):
    assert len(fetch(harness, Range=header).content) == 1


def test_the_report_counts_the_bytes_of_pulls_through_the_versioned_url(harness):
    from blocktrain.protocol.store.history import from_state

    c = AggregatorClient("http://agg", harness.alice, client=harness.client, rng=random.Random(0))
    c.register(block=0)
    pulled = c.pull(0)  # a 303, then the version's body
    delta = {k: torch.full_like(v, 0.01) for k, v in pulled.tensors.items()}
    pushed = c.push(0, delta, base_version=0, round=0, tokens=64)
    assert pushed.accepted
    harness.service.flush_traffic()
    (point,) = from_state(harness.state).points
    assert point.bytes_total == pushed.nbytes + pulled.nbytes  # not the push alone
