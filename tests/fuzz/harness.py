"""Schemathesis against the three HTTP apps, in this process: the aggregator, a block host and
the router, at the micro shape. Used by tests/fuzz/test_fuzz.py (a quick, seeded run) and by
bench/fuzz.py (2,000+ cases per app).

Each case is either generated from the app's OpenAPI schema (positive and negative data) or a
safetensors body from `bodies.py`, and is sent with a valid token (so that it reaches past
authentication), with none, with a wrong one, or with whatever the schema made up. Every answer
is checked: below 500, and conforming to the response schema where one is declared. An exception
escaping the app counts as a 500 (the test client answers 500 for it, as uvicorn would).
"""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import schemathesis
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

from blocktrain.data import load_split
from blocktrain.httpserve import Limits
from blocktrain.protocol.http.app import create_app as create_aggregator_app
from blocktrain.protocol.service.access import JSON_BODY_BYTES, AccessLimits
from blocktrain.protocol.store.tokens import new_token
from blocktrain.serving import (
    HostSettings,
    ModelSource,
    RouterSettings,
    create_host_app,
    create_router_app,
)
from blocktrain.serving.shared.auth import auth_headers
from blocktrain.serving.shared.wire import CONTENT_TYPE
from blocktrain.serving.shared.wire import encode as serving_encode
from blocktrain.training import Trainer
from blocktrain.training.local import initial_blocks
from tests.conftest import TEXT, micro_config
from tests.fuzz.bodies import JSON_VALUES, NUMBERISH, malformed
from tests.protocol.conftest import FakeClock, add_token, delta_body, run_state

# Safetensors bodies travel as they are, like application/octet-stream.
schemathesis.serializer.alias(CONTENT_TYPE, "application/octet-stream")

CHECKS = [not_a_server_error, response_schema_conformance]
AUTH_MODES = ["valid", "valid", "valid", "none", "wrong", "generated"]
"""How a case authenticates: mostly with a valid token, so that the fuzzer gets past auth."""


@dataclass
class Target:
    """One app under fuzzing."""

    name: str
    client: TestClient
    schema: Any
    valid_headers: dict[str, str]
    """What an honest caller sends (a token, a worker id)."""
    paths: dict[str, int] = field(default_factory=dict)
    """Path parameters an honest caller uses (e.g. a block that exists)."""
    bodies: list[tuple[str, st.SearchStrategy[bytes]]] = field(default_factory=list)
    """(operation label, safetensors bodies) to send besides the generated cases."""
    samples: dict[str, bytes] = field(default_factory=dict)
    """A well-formed body per operation label (what `bodies` break)."""
    clamp: dict[str, float] = field(default_factory=dict)
    """Numeric query parameters held below a bound (a long poll's `wait`: held by design)."""


@dataclass
class Report:
    cases: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    """By check ('not_a_server_error', 'response_schema_conformance', ...)."""
    examples: list[str] = field(default_factory=list)
    """The first few failures: the check, the request and the answer."""

    def to_json(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "seconds": round(self.seconds, 2),
            "failures": sum(self.failures.values()),
            "failures_by_check": dict(self.failures),
            "failures_by_status": {str(s): n for s, n in sorted(self.statuses.items()) if s >= 500},
            "statuses": {str(s): n for s, n in sorted(self.statuses.items())},
            "examples": self.examples,
        }


# ---------------------------------------------------------------------------------------------
# The apps
# ---------------------------------------------------------------------------------------------


def _schema(app: FastAPI) -> Any:
    """The app's OpenAPI schema, detached from the app: schemathesis would otherwise reach the
    app through clients of its own, whose exit runs the app's shutdown (closing its clients)."""
    return schemathesis.openapi.from_dict(app.openapi())


def _client(app: FastAPI, stack: ExitStack, base_url: str = "http://testserver") -> TestClient:
    return stack.enter_context(TestClient(app, base_url=base_url, raise_server_exceptions=False))


def aggregator(root: Path, stack: ExitStack) -> Target:
    """An aggregator on a micro run's state folder, one token, one registered worker."""
    state = run_state(root / "state", micro_config(), {})
    stack.callback(state.close)
    token = add_token(state, "fuzz")
    # failed token checks unlimited: a fifth of the cases guess, and a locked-out address
    # would answer every later case 429 (tests/protocol/service/test_access.py tests the lock)
    limits = AccessLimits(http=Limits(max_body=JSON_BODY_BYTES, failed_auth_burst=1 << 30))
    app = create_aggregator_app(storage=state, clock=FakeClock(), limits=limits)
    client = _client(app, stack)
    auth = {"Authorization": f"Bearer {token}"}
    worker = client.post("/v1/workers", json={"block": 0}, headers=auth).json()["worker_id"]
    valid = {**auth, "X-Worker-Id": str(worker)}
    zeros = {k: torch.zeros_like(v) for k, v in initial_blocks(micro_config())[0].items()}
    honest = delta_body(0, tensors=zeros)
    meta = st.fixed_dictionaries(
        {"block": NUMBERISH, "base_version": NUMBERISH, "round": NUMBERISH, "tokens": NUMBERISH}
    )
    return Target(
        "aggregator",
        client,
        _schema(app),
        valid,
        {"block": micro_config().model.blocks, "worker_id": worker + 1},
        [("POST /v1/blocks/{block}/updates", malformed(honest, meta))],
        {"POST /v1/blocks/{block}/updates": honest},
        {"wait": 0.05},
    )


def micro_runs(root: Path) -> tuple[Path, Path]:
    """A micro BlockTrain run and its reference, trained for 2 steps (a few seconds)."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "wiki.train.raw").write_text(TEXT * 40)
    train = load_split(corpus, "train")
    for kind in ("blocktrain", "reference"):
        if not (root / kind).exists():
            Trainer.create(micro_config(steps=2), root / kind, train, None, kind=kind).run(
                progress=False
            )
    return root / "blocktrain", root / "reference"


HOST_URL = "http://host0:8101"
HOST_SECRET = "fuzz-shared-secret-0123456789"
"""Router and host share it, as deployed (docs/serving.md, Trust): the fuzzer's honest cases
carry it, the others test the host's refusal of callers without it."""


class _OneHost(httpx.AsyncBaseTransport):
    """The router's network: the one in-process host; anything else refuses connections."""

    def __init__(self, app: FastAPI) -> None:
        self.inner = httpx.ASGITransport(app=app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if f"{request.url.scheme}://{request.url.host}:{request.url.port}" != HOST_URL:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)


def serving(root: Path, stack: ExitStack) -> tuple[Target, Target]:
    """A block host holding every block and stage of a micro run (so that a sweep ends there,
    whatever route it names), and a router in front of it with small per-request limits."""
    bt, ref = micro_runs(root / "runs")
    host_settings = HostSettings(
        models=(ModelSource("bt", bt), ModelSource("ref", ref)),
        parts=(0, 1, 2),
        public_url=HOST_URL,
        secret=HOST_SECRET,
    )
    # it holds every part, so it never forwards: a route the fuzzer names leads nowhere
    host_app = create_host_app(host_settings, transport=httpx.MockTransport(_refuse))
    router_app = create_router_app(
        RouterSettings(
            hosts=(HOST_URL,), max_output_bytes=8, max_steps_per_block=2, secret=HOST_SECRET
        ),
        transport=_OneHost(host_app),
    )
    host_client = _client(host_app, stack, HOST_URL)
    info = host_client.get("/v1/info", headers=auth_headers(HOST_SECRET)).json()
    prints = {m["name"]: m["fingerprint"] for m in info["models"]}
    cfg = micro_config().model
    x = torch.tensor([list(b"hello world!"[: cfg.seq_len - cfg.span])], dtype=torch.uint8)
    z = torch.randn(1, cfg.span, cfg.d_model, generator=torch.Generator().manual_seed(0))
    sweep_header = {"model": "bt", "fingerprint": prints["bt"], "step": 0}
    stage_header = {"model": "ref", "fingerprint": prints["ref"], "session": "s", "pos": 0}
    sweep = serving_encode({"x": x, "z": z}, sweep_header)
    stage = serving_encode({"x": x}, stage_header)

    def headers(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        fields = {k: st.just(v) | JSON_VALUES for k, v in base.items()}
        extra = {
            "route": st.none() | st.lists(st.text(max_size=30), max_size=3),
            "final": st.sampled_from(["logits", "bytes", "x"]),
            "steps_per_block": st.integers(-1, 70),
            "sampler": st.sampled_from(["euler", "ancestral", "heun", "nope"]),
            "drafted": st.integers(-1, 70),
            "draws": st.integers(-1, 20),
            "fork": st.integers(-1, 8),
            "wire_dtype": st.sampled_from(["fp32", "fp16", "bf16"]),
            "step": st.integers(-1, 40),
            "pos": st.integers(-1, 40),
            "stage": st.integers(-1, 4),
            "verify": st.integers(-1, 70),
        }
        extra = {k: v for k, v in extra.items() if k not in fields}
        return st.fixed_dictionaries(fields, optional=extra).map(
            lambda h: {"blocktrain": json.dumps(h)}
        )

    host = Target(
        "host",
        host_client,
        _schema(host_app),
        auth_headers(HOST_SECRET),
        bodies=[
            ("POST /v1/sweep", malformed(sweep, headers(sweep_header))),
            ("POST /v1/stage", malformed(stage, headers(stage_header))),
        ],
        samples={"POST /v1/sweep": sweep, "POST /v1/stage": stage},
    )
    router = Target(
        "router",
        _client(router_app, stack),
        _schema(router_app),
        {},
    )
    return host, router


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


@contextmanager
def targets(root: Path) -> Iterator[dict[str, Target]]:
    """The three apps, served in this process until the block exits."""
    with ExitStack() as stack:
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny models: torch's thread pool only costs here
        stack.callback(torch.set_num_threads, before)
        host, router = serving(root, stack)
        yield {"aggregator": aggregator(root, stack), "host": host, "router": router}


# ---------------------------------------------------------------------------------------------
# The fuzzer
# ---------------------------------------------------------------------------------------------


def _auth(headers: dict[str, Any], mode: str, valid: dict[str, str]) -> dict[str, Any]:
    out = {k: v for k, v in headers.items() if k.lower() not in ("authorization",)}
    if mode == "valid":
        return {**out, **valid}
    if mode == "wrong":
        return {**out, "Authorization": f"Bearer {new_token()}"}
    if mode == "generated" and "authorization" in {k.lower() for k in headers}:
        return dict(headers)
    return out


def _send(target: Target, kwargs: dict[str, Any], chunked: bool) -> httpx.Response:
    body = kwargs.get("data")
    if isinstance(body, str):
        body = body.encode()
    blob = body
    if chunked and blob is not None:  # no Content-Length: Transfer-Encoding: chunked
        body = iter([blob[i : i + 4096] for i in range(0, len(blob), 4096)] or [b""])
    response = target.client.request(
        kwargs["method"],
        kwargs["url"],
        headers=kwargs.get("headers"),
        params=kwargs.get("params"),
        json=kwargs.get("json"),
        content=body,
    )
    if chunked and blob is not None:
        response.request._content = blob  # the stream is spent; the checks read the body
    return response


def cases(target: Target) -> st.SearchStrategy[Any]:
    """(case, auth mode, use honest path parameters, send chunked) for one target."""
    generated = [
        target.schema.as_strategy(generation_mode=mode)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    ops = {op.ok().label: op.ok() for op in target.schema.get_all_operations()}
    crafted = [
        body.map(
            lambda b, op=ops[label]: op.Case(
                path_parameters={"block": 0}, body=b, media_type=CONTENT_TYPE
            )
        )
        for label, body in target.bodies
        if label in ops
    ]
    return st.tuples(
        st.one_of(*generated, *crafted),
        st.sampled_from(AUTH_MODES),
        st.booleans(),
        st.integers(0, 5),
    )


def fuzz(target: Target, n_cases: int, seed_value: int = 0, keep: int = 5) -> Report:
    """Send `n_cases` cases to `target` (reproducibly, from `seed_value`) and check each answer."""
    report = Report()

    @settings(
        max_examples=n_cases,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed(seed_value)
    @given(cases(target))
    def run(drawn: tuple[Any, str, bool, int]) -> None:
        case, mode, honest_paths, chunk_odds = drawn
        if honest_paths:
            for name, n in target.paths.items():
                if name in case.path_parameters:
                    case.path_parameters[name] = chunk_odds % n
        for name, bound in target.clamp.items():
            value = (case.query or {}).get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound:
                case.query[name] = bound
        kwargs = case.as_transport_kwargs()
        kwargs["headers"] = _auth(kwargs.get("headers") or {}, mode, target.valid_headers)
        report.cases += 1
        try:
            response = _send(target, kwargs, chunked=chunk_odds == 0)
        except Exception as exc:  # an answer the client cannot read counts as a crash
            report.failures["crash"] += 1
            _keep(report, keep, f"crash: {case.operation.label}: {exc!r}")
            return
        report.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:
            names = [f.title for f in group.exceptions]
            for name in names:
                report.failures[name] += 1
            _keep(
                report,
                keep,
                f"{names}: {kwargs['method']} {kwargs['url']} ({mode}) -> "
                f"{response.status_code} {response.text[:300]}",
            )

    t0 = time.perf_counter()
    with warnings.catch_warnings():  # hypothesis describes the megabyte bodies, and says so
        warnings.filterwarnings("ignore", message="Generating overly large repr")
        run()
    report.seconds = time.perf_counter() - t0
    return report


def _keep(report: Report, keep: int, text: str) -> None:
    if len(report.examples) < keep:
        report.examples.append(text)


def fuzz_all(
    root: Path, n_cases: int, seed_value: int = 0, log: Callable[[str], None] = print
) -> dict[str, Report]:
    with targets(root) as apps:
        out = {}
        for name, target in apps.items():
            out[name] = fuzz(target, n_cases, seed_value)
            log(f"{name}: {out[name].to_json()}")
        return out
