"""The OpenAI API of the router, through the real `openai` client: completions and chat, plain
and streamed, with every parameter the router honours (stop, n, logprobs, echo, seed, user),
per-request timings, and errors in OpenAI's shape."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from blocktrain.model import Sampling, utf8
from blocktrain.serving.openai.chat import Message, chat_prompt
from blocktrain.serving.openai.choices import StopScanner, byte_token
from tests.serving.conftest import in_process

PROMPT = "The game "


def client_of(router: TestClient) -> openai.OpenAI:
    """The openai client, its HTTP going into the router app in this process."""
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=router, max_retries=0
    )


@pytest.fixture
def client(router: TestClient) -> Iterator[openai.OpenAI]:
    yield client_of(router)
    assert router.app.state.router.work.in_flight == 0, "every request released its work"  # type: ignore[attr-defined]


def raw_bytes(router: TestClient, seed: int, n: int, prompt: str = PROMPT) -> bytes:
    """The bytes the chain generates for `seed` (the router's own /v1/generate), kept to UTF-8
    as the OpenAI routes keep them by default."""
    body = {"model": "bt", "prompt": prompt, "max_bytes": n, "seed": seed, "utf8": True}
    return bytes(router.post("/v1/generate", json=body).json()["bytes"])


def whole_characters(data: bytes) -> bytes:
    """A UTF-8 generation without the character its budget cut short."""
    return data[: utf8.complete_length(data)]


def token_bytes(token: str) -> int:
    """byte_token's inverse."""
    return int(token.removeprefix("bytes:\\x"), 16) if token.startswith("bytes:") else ord(token)


def text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


# --- seed, n, echo, user ------------------------------------------------------------------------


def test_a_seed_repeats_a_completion_and_another_seed_changes_it(client, stack):
    def make(seed: int | None) -> openai.types.Completion:
        return client.completions.create(model="bt", prompt=PROMPT, max_tokens=12, seed=seed)

    first, again, other = make(7), make(7), make(8)
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].text != other.choices[0].text
    same = in_process(stack, PROMPT.encode(), 12, 7, Sampling(utf8=True))
    assert first.choices[0].text == text(whole_characters(bytes(same)))
    unseeded = make(None)
    replay = make(unseeded.model_extra["seed"])
    assert replay.choices[0].text == unseeded.choices[0].text, "the seed sent back replays it"


def test_n_choices_are_each_their_own_sample(client, router):
    done = client.completions.create(model="bt", prompt=PROMPT, max_tokens=10, n=3, seed=40)
    assert [c.index for c in done.choices] == [0, 1, 2]
    texts = [c.text for c in done.choices]
    assert texts == [text(raw_bytes(router, 40 + i, 10)) for i in range(3)], "choice i: seed + i"
    assert len(set(texts)) == 3
    assert done.usage is not None and done.usage.completion_tokens == 30


def test_n_counts_against_the_work_caps(cluster):
    with cluster.router(max_work=40, max_work_in_flight=40) as router:
        client = client_of(router)
        client.completions.create(model="bt", prompt=PROMPT, max_tokens=20, n=2, seed=1)
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            client.completions.create(model="bt", prompt=PROMPT, max_tokens=20, n=3)
        assert "n x max_tokens x steps_per_block = 3 x 20 x 1 = 60 units" in exc.value.message
        assert exc.value.body["param"] == "max_tokens"


def test_echo_returns_the_prompt_before_the_completion(client):
    plain = client.completions.create(model="bt", prompt=PROMPT, max_tokens=6, seed=3)
    echoed = client.completions.create(model="bt", prompt=PROMPT, max_tokens=6, seed=3, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    stream = client.completions.create(
        model="bt", prompt=PROMPT, max_tokens=6, seed=3, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == PROMPT + plain.choices[0].text


def test_the_user_is_recorded_in_the_log(client, caplog):
    caplog.set_level(logging.INFO, logger="blocktrain.serving.openai.openai_api")
    client.completions.create(model="bt", prompt=PROMPT, max_tokens=2, user="alice-42")
    client.chat.completions.create(
        model="bt", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="bob-7"
    )
    logged = caplog.text
    assert "user alice-42" in logged and "user bob-7" in logged


# --- stop ---------------------------------------------------------------------------------------


def test_stop_scanner_cuts_at_the_first_stop_even_across_pieces():
    scanner = StopScanner([b"bc", b"zz"])
    assert scanner.push(b"ab") == (b"a", False), "b may begin 'bc': held back"
    assert scanner.push(b"cd") == (b"", True)
    scanner = StopScanner([b"xyz"])
    assert scanner.push(b"abxy") == (b"ab", False)
    assert scanner.push(b"q") == (b"xyq", False), "no longer the start of a stop: sent"
    assert scanner.push(b"xy") == (b"", False) and scanner.flush() == b"xy"


def reference_scan(stops: list[bytes], pieces: list[bytes]) -> tuple[bytes, bool]:
    """What the scanner must give, by the plain search it replaced: the text up to the first
    stop sequence found in (held bytes + piece), holding back what could begin one."""
    sent, held = b"", b""
    for data in pieces:
        buf = held + data
        found = [i for i in (buf.find(s) for s in stops) if i >= 0]
        if found:
            return sent + buf[: min(found)], True
        hold = max((k for s in stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        sent, held = sent + buf[: len(buf) - hold], buf[len(buf) - hold :]
    return sent + held, False


def scan(scanner: StopScanner, pieces: list[bytes]) -> tuple[bytes, bool]:
    sent = b""
    for data in pieces:
        out, stopped = scanner.push(data)
        sent += out
        if stopped:
            return sent, True
    return sent + scanner.flush(), False


def test_stop_scanner_agrees_with_a_plain_search():
    rng = random.Random(3)
    for _ in range(600):
        stops = [
            bytes(rng.choice(b"ab") for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 4))
        ]
        pieces = [
            bytes(rng.choice(b"abc") for _ in range(rng.randint(0, 4)))
            for _ in range(rng.randint(1, 8))
        ]
        assert scan(StopScanner(stops), pieces) == reference_scan(stops, pieces), (stops, pieces)


class CountedBytes(bytes):
    """A stop sequence that counts the bytes read out of it (indexing and slicing)."""

    reads = 0

    def __getitem__(self, key):  # type: ignore[override]
        out = super().__getitem__(key)
        CountedBytes.reads += len(out) if isinstance(out, bytes) else 1
        return out


def test_stop_scanner_reads_each_stop_a_bounded_number_of_times_per_byte():
    """Regression: the scan re-read every prefix of every stop sequence for each piece, O(L^2)
    per piece; 4 stops of 250 KB held the event loop 9 s for 2 bytes. Now each generated byte
    costs a bounded number of reads per stop, whatever the stops' length."""
    stops = [CountedBytes(b"a" * 1023 + bytes([c])) for c in b"bcde"]
    scanner = StopScanner(list(stops))
    CountedBytes.reads = 0
    n = 2000
    sent = b"".join(scanner.push(b"a")[0] for _ in range(n))
    assert sent == b"a" * (n - 1023), "1023 bytes may begin a stop: held back"
    assert CountedBytes.reads <= 3 * n * len(stops), CountedBytes.reads
    assert scanner.push(b"d") == (b"", True), "the held bytes and this one are a stop sequence"


def test_four_long_stop_sequences_are_refused_before_any_work(client, router):
    """Regression: 4 stop strings of 250 KB (a 1 MB body) were taken, and scanned on the event
    loop. Now a stop sequence over 1 KiB is a 400 naming `stop`, before any host computes."""
    stop = ["x" * 250_000 + str(i) for i in range(4)]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="bt", prompt=PROMPT, max_tokens=2, stop=stop)
    assert "stop: a stop sequence may hold at most 1024 bytes" in str(err.value)
    longest = ["y" * 1023 + str(i) for i in range(4)]  # at the cap: served
    done = client.completions.create(model="bt", prompt=PROMPT, max_tokens=4, stop=longest)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4


def test_generation_ends_before_the_first_stop_sequence(client, router):
    data = raw_bytes(router, 11, 40)
    # An ASCII byte past the start, so that it can be sent as a str; the text ends before its
    # first occurrence.
    cut = next(i for i in range(1, len(data)) if data[i] < 0x80)
    stop = chr(data[cut])
    expected = text(data[: data.index(data[cut])])
    req = {"model": "bt", "prompt": PROMPT, "max_tokens": 40, "seed": 11}
    done = client.completions.create(**req, stop=["\x00never\x00", stop])
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "stop"
    assert done.model_extra["timings"]["traversals"] < 20, "it stopped generating early"
    chunks = list(client.completions.create(**req, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(stop not in c.choices[0].text for c in chunks)
    unstopped = client.completions.create(**req, stop="\x00never\x00")
    assert unstopped.choices[0].finish_reason == "length"
    assert unstopped.choices[0].text == text(data)


# --- logprobs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bt", "ref"])
def test_greedy_logprobs_name_each_byte_as_the_likeliest(client, model):
    done = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=7, temperature=0, logprobs=3, seed=1
    )
    lp = done.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 7
    assert text(bytes(token_bytes(t) for t in lp.tokens)) == done.choices[0].text
    assert lp.top_logprobs is not None
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and value < 0 and math.isfinite(value)
        best = max(top, key=top.get)
        assert best == token and top[best] == pytest.approx(value), "greedy takes the likeliest"
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_logprobs_follow_the_samplers_distribution(client):
    done = client.completions.create(
        model="bt", prompt=PROMPT, max_tokens=5, logprobs=20, seed=2, extra_body={"top_k": 4}
    )
    lp = done.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 4, "top_k = 4 leaves four bytes to draw from"
        assert sum(math.exp(v) for v in top.values()) == pytest.approx(1, abs=1e-4)
        assert top[token] == pytest.approx(value)


def test_logprobs_are_refused_where_the_router_cannot_give_them(client, cluster):
    with pytest.raises(openai.BadRequestError, match="echo with logprobs") as exc:
        client.completions.create(model="bt", prompt=PROMPT, max_tokens=3, logprobs=1, echo=True)
    assert exc.value.body["param"] == "logprobs"
    with (
        cluster.router(sample_on="last-host") as router,
        pytest.raises(openai.BadRequestError, match="sample_on=last-host"),
    ):
        client_of(router).completions.create(model="bt", prompt=PROMPT, max_tokens=3, logprobs=0)


def test_byte_tokens_are_text_or_an_escape():
    assert byte_token(ord("a")) == "a" and byte_token(0xE2) == "bytes:\\xe2"


# --- chat ---------------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Who "}, {"type": "text", "text": "won?"}],
    },
]


def test_the_chat_template_is_a_line_per_message_then_the_replys_prefix():
    messages = [Message.model_validate(m) for m in MESSAGES]
    assert chat_prompt(messages) == "system: Be brief.\nuser: Who won?\nassistant: "


def test_a_chat_reply_is_the_templates_continuation_up_to_a_newline(client):
    prompt = "system: Be brief.\nuser: Who won?\nassistant: "
    for seed in range(4):
        reply = client.chat.completions.create(
            model="bt", messages=MESSAGES, max_completion_tokens=30, seed=seed, stop=["@@"]
        )
        same = client.completions.create(
            model="bt", prompt=prompt, max_tokens=30, seed=seed, stop=["@@", "\n"]
        )
        choice = reply.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == same.choices[0].text
        assert choice.finish_reason == same.choices[0].finish_reason
        assert "\n" not in (choice.message.content or "")
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)


def test_a_chat_reply_ends_before_the_requests_own_stop_sequence(client):
    req = {"model": "bt", "messages": MESSAGES, "max_tokens": 40, "seed": 9, "stop": ["@@"]}
    reply = client.chat.completions.create(**req).choices[0].message.content or ""
    stop = next(ch for ch in reply[1:] if ch.isascii())
    stopped = client.chat.completions.create(**{**req, "stop": ["@@", stop]}).choices[0]
    assert stopped.message.content == reply[: reply.index(stop)]
    assert stopped.finish_reason == "stop"


def test_chat_streams_n_choices_with_logprobs(client):
    req = {
        "model": "bt",
        "messages": MESSAGES,
        "max_tokens": 12,
        "n": 2,
        "seed": 5,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**req)
    chunks = list(client.chat.completions.create(**req, stream=True))
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert mine[-1].finish_reason == choice.finish_reason
        assert choice.logprobs is not None and choice.logprobs.content is not None
        tokens = choice.logprobs.content
        assert text(bytes(b for t in tokens for b in t.bytes)) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
        streamed = [t for c in mine if c.logprobs for t in c.logprobs.content or []]
        assert [t.token for t in streamed] == [t.token for t in tokens]
    assert whole.choices[0].message.content != whole.choices[1].message.content


@pytest.mark.parametrize(
    ("change", "param", "reason"),
    [
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "messages.0.content: a byte-level model reads text parts only, not 'image_url'",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ({"max_tokens": 3, "max_completion_tokens": 3}, None, "not both"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unknown parameter"),
    ],
)
def test_bad_chat_requests_are_400_in_openais_shape(client, change, param, reason):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**{"model": "bt", "messages": MESSAGES, **change})
    body = exc.value.body
    assert {"message", "type", "param", "code"} <= body.keys() and body["param"] == param
    assert reason in body["message"] and body["type"] == "invalid_request_error"


# --- timings and errors -------------------------------------------------------------------------


def test_every_response_carries_its_timings(client, cluster):
    done = client.completions.create(model="bt", prompt=PROMPT, max_tokens=7, seed=1)
    t = done.model_extra["timings"]
    assert t["traversals"] == 4, "ceil(7 / K) with K = 2"
    assert [h["host"] for h in t["hops"]] == cluster.urls
    assert all(h["compute_ms"] > 0 for h in t["hops"])
    assert sum(h["compute_ms"] for h in t["hops"]) == pytest.approx(t["host_compute_ms"])
    assert t["queue_ms"] >= 0 and 0 < t["prefill_ms"] <= t["total_ms"]
    assert t["host_compute_ms"] <= t["chain_ms"]
    chat = client.chat.completions.create(
        model="ref", messages=MESSAGES, max_tokens=3, n=2, temperature=0
    )
    assert chat.model_extra["timings"]["traversals"] <= 6
    stream = list(
        client.chat.completions.create(model="bt", messages=MESSAGES, max_tokens=5, stream=True)
    )
    assert stream[-1].model_extra["timings"]["traversals"] >= 1
    assert all(c.model_extra.get("timings") is None for c in stream[:-1])


def test_errors_reach_the_client_in_openais_shape(cluster):
    # 2 a minute: the body over its cap is refused (413) before the rate limit counts it
    with cluster.router(rate_per_minute=2, max_body_bytes=2000) as router:
        client = client_of(router)
        with pytest.raises(openai.NotFoundError) as nf:
            client.chat.completions.create(model="gpt-4", messages=MESSAGES)
        assert nf.value.body["code"] == "model_not_found" and nf.value.body["param"] == "model"
        with pytest.raises(openai.APIStatusError) as big:
            client.completions.create(model="bt", prompt="x" * 3000)
        assert big.value.status_code == 413 and "limit is 2000" in big.value.message
        cluster.apps.down.add(cluster.urls[1])
        with pytest.raises(openai.InternalServerError) as down:
            client.completions.create(model="bt", prompt=PROMPT, max_tokens=2)
        assert down.value.status_code == 503 and down.value.body["host"] == cluster.urls[1]
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model="bt", prompt=PROMPT, max_tokens=2)
        assert limited.value.body["type"] == "rate_limit_error"


def test_a_chain_failing_mid_stream_ends_every_choice_with_an_error(cluster, router):
    client = client_of(router)
    calls = {"n": 0}

    def die_later(url: str, _request: object) -> None:
        if url == cluster.urls[2] and "/v1/sweep" in str(_request.url):  # type: ignore[attr-defined]
            calls["n"] += 1
            if calls["n"] > 3:
                cluster.apps.down.add(url)

    cluster.apps.before = die_later
    stream = client.chat.completions.create(
        model="bt", messages=MESSAGES, max_tokens=30, n=2, stream=True, stop=["@@"]
    )
    with pytest.raises(openai.APIError, match="unavailable"):
        for _ in stream:
            pass
    assert router.app.state.router.work.in_flight == 0  # type: ignore[attr-defined]
