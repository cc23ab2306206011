"""UTF-8 constrained decoding through the router: the OpenAI routes' text is valid UTF-8 by
default (`utf8: false` turns it off, and the barely trained micro runs then write U+FFFD), the
chain writes what `generate --utf8` writes, speculative verification rejects invalid drafts, and the
logprobs are those of the constrained law."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from blocktrain.model import Sampling, SigmaSchedule, stack_denoiser, utf8
from blocktrain.model.speculative import generate_speculative
from blocktrain.serving.router.chain_router import Router
from blocktrain.serving.router.router_settings import RouterSettings
from blocktrain.serving.shared.serving_errors import ServingError
from blocktrain.training import load_model
from tests.serving.conftest import in_process
from tests.serving.openai.test_openai_api import client_of, token_bytes, whole_characters

PROMPT = "Señor "


def valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("model", ["bt", "ref"])
def test_openai_text_is_valid_utf8_unless_the_request_says_utf8_false(cluster, model):
    with cluster.router() as router:
        client = client_of(router)

        def complete(seed: int, **extra: object) -> str:
            done = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=24, seed=seed, **extra
            )
            return done.choices[0].text

        free = [complete(s, extra_body={"utf8": False}) for s in range(3)]
        assert any("\ufffd" in t for t in free), "the micro runs write invalid bytes"
        for seed in range(3):
            text = complete(seed)
            assert "\ufffd" not in text and 21 <= len(text.encode()) <= 24
            streamed = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=24, seed=seed, stream=True
            )
            chunks = [c.choices[0].text for c in streamed]
            assert "".join(chunks) == text and all("\ufffd" not in c for c in chunks)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "¿Qué?"}], max_tokens=30, n=3
        )
        assert all("\ufffd" not in (c.message.content or "") for c in chat.choices)


@pytest.mark.parametrize("sample_on", ["router", "last-host"])
def test_the_chain_writes_what_generate_utf8_writes(cluster, stack, sample_on):
    body = {"model": "bt", "prompt": PROMPT, "max_bytes": 21, "seed": 6, "utf8": True}
    with cluster.router(sample_on=sample_on) as router:
        got = router.post("/v1/generate", json=body).json()
        free = router.post("/v1/generate", json={**body, "utf8": False}).json()
    expected = in_process(stack, PROMPT.encode(), 21, 6, Sampling(utf8=True))
    assert got["bytes"] == list(whole_characters(bytes(expected)))
    assert valid(bytes(got["bytes"])) and not valid(bytes(free["bytes"]))


class HighByteDrafter:
    """Drafts bytes 0x80..0xFF uniformly: never valid UTF-8 after a boundary."""

    def draft(self, context, n, generator):
        laws = torch.zeros(n, 256, dtype=torch.float64)
        laws[:, 0x80:] = 1 / 128
        return [
            int(b) for b in torch.multinomial(laws[0], n, True, generator=generator)
        ] if n else [], laws


def test_speculative_verification_through_the_chain_keeps_to_utf8(cluster, runs):
    _, k1 = load_model(runs.next_byte)
    drafter = HighByteDrafter()
    body = {"model": "bt1", "prompt": PROMPT, "max_bytes": 20, "seed": 3, "draft_bytes": 3}
    with cluster.router(drafter=drafter) as router:
        got = router.post("/v1/generate", json={**body, "utf8": True}).json()
        free = router.post("/v1/generate", json=body).json()
    expected, _ = generate_speculative(
        stack_denoiser(k1),
        torch.tensor([list(PROMPT.encode())]),
        20,
        drafter=drafter,
        draft_len=3,
        grid=SigmaSchedule.from_config(k1.cfg).sampler_grid(1),
        targets=k1.targets,
        seq_len=k1.cfg.seq_len,
        sampling=Sampling(utf8=True),
        generator=torch.Generator().manual_seed(3),
    )
    assert got["bytes"] == list(whole_characters(bytes(expected[0].tolist())))
    assert valid(bytes(got["bytes"])) and not valid(bytes(free["bytes"]))


def test_logprobs_are_those_of_the_constrained_law(cluster):
    def alternatives(utf8_on: bool) -> list[tuple[int, list[int]]]:
        """(the automaton's state, the bytes listed as likeliest) at each byte of a choice."""
        with cluster.router() as router:
            done = client_of(router).completions.create(
                model="bt",
                prompt=PROMPT,
                max_tokens=24,
                seed=8,
                logprobs=8,
                temperature=1.5,
                extra_body={"utf8": utf8_on},
            )
        lp = done.choices[0].logprobs
        assert lp is not None and lp.top_logprobs is not None
        data = bytes(token_bytes(t) for t in lp.tokens)
        if utf8_on:
            assert data.decode("utf-8") == done.choices[0].text
            assert any(b >= 0x80 for b in data), "the text holds multi-byte characters"
        state, out = utf8.state_after(PROMPT.encode()), []
        assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs)
        for byte, top in zip(data, lp.top_logprobs, strict=True):
            out.append((state, [token_bytes(t) for t in top]))
            state = utf8.step(state, byte)
        return out

    def allowed(state: int, b: int) -> bool:
        return bool(utf8.ALLOWED[state, b])

    kept = alternatives(True)
    assert all(allowed(state, b) for state, top in kept for b in top)
    free = alternatives(False)
    assert not all(allowed(state, b) for state, top in free for b in top), "could fail"


def test_a_host_refuses_to_draw_utf8_bytes_it_has_no_context_for(cluster):
    """The router draws the final bytes of a UTF-8 request itself, whatever sample_on says; a
    host asked to draw them (final = bytes with utf8, as a router that did not would ask) says
    why instead of drawing them blind: the last stage holds only the newest bytes."""

    async def ask() -> None:
        async with httpx.AsyncClient(transport=cluster.apps) as http:
            router = Router(RouterSettings(hosts=tuple(cluster.urls), sample_on="last-host"), http)
            chain = router.chain(await router.resolve("ref"))
            chain._final = lambda sampling: "bytes"  # type: ignore[method-assign]
            await chain.stage_step(
                torch.tensor([list(b"ab")]),
                session="s",
                pos=0,
                close=True,
                sampling=Sampling(utf8=True),
                generator=torch.Generator(),
            )

    with pytest.raises(ServingError, match="utf8 sampling draws the final bytes where the context"):
        asyncio.run(ask())
