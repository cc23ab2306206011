"""The router's OpenAI-compatible routes, `POST /v1/completions` and `POST /v1/chat/completions`,
plain or streamed (SSE), over the choices of choices.py (docs/serving.md, "The OpenAI API")."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from blocktrain.serving.openai.chat import (
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    ChunkChoice,
    Delta,
    TokenLogprob,
    TopLogprob,
    chat_prompt,
)
from blocktrain.serving.openai.choices import (
    ByteLogprob,
    Finish,
    Piece,
    Run,
    Text,
    byte_token,
    start_run,
)
from blocktrain.serving.openai.schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from blocktrain.serving.router.chain_router import Router
from blocktrain.serving.router.limits import (
    CLIENT_GONE,
    ClientGone,
    holder_of,
    while_connected,
)
from blocktrain.serving.router.router_settings import RouterSettings
from blocktrain.serving.shared.serving_errors import BadRequest, ServingError

log = logging.getLogger(__name__)


class _Stalled(Exception):
    """A stream's client read nothing for the send timeout, or no room came back for it."""


RESUME_POLL_S = 0.05
"""How often a parked stream whose client reads again looks for room for its work."""


class _Stream(StreamingResponse):
    """Server-sent events that hold their request's work in flight until the response ends,
    however it ends (even a client that hung up before the first event). A send waiting more
    than `park_after_s` parks the run's work (docs/serving.md, "Settings"); one waiting more
    than `send_timeout_s` ends the stream, and the server closes the connection."""

    def __init__(
        self,
        events: AsyncGenerator[str],
        run: Run,
        release: Callable[[], Awaitable[None]],
        settings: RouterSettings,
    ):
        super().__init__(events, media_type="text/event-stream")
        self._run, self._release = run, release
        self._park_after_s = min(settings.park_after_s, settings.send_timeout_s)
        self._send_timeout_s = settings.send_timeout_s

    async def _timed_send(self, send: Send, message: MutableMapping[str, Any]) -> None:
        sending = asyncio.ensure_future(send(message))
        try:
            done, _ = await asyncio.wait({sending}, timeout=self._park_after_s)
            if not done:
                self._run.park()
                rest = self._send_timeout_s - self._park_after_s
                done, _ = await asyncio.wait({sending}, timeout=rest)
                if not done:
                    raise _Stalled(f"its client read nothing for {self._send_timeout_s:.0f} s")
        finally:
            if not sending.done():
                sending.cancel()
        sending.result()
        last = message["type"] == "http.response.body" and not message.get("more_body")
        if not last and not self._run.resume():  # nothing is computed until it fits again
            loop = asyncio.get_running_loop()
            end = loop.time() + self._send_timeout_s
            while not self._run.resume():
                if loop.time() > end:
                    raise _Stalled(
                        f"its client read again, but no room for its work came back in "
                        f"{self._send_timeout_s:.0f} s"
                    )
                await asyncio.sleep(RESUME_POLL_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, functools.partial(self._timed_send, send))
        except _Stalled as why:
            log.warning("a stream ended, its work released: %s", why)
        finally:
            await self._release()


@dataclass
class _Choice:
    """One choice's text and logprobs as its pieces come."""

    text: Text
    parts: list[str] = field(default_factory=list)
    logprobs: list[ByteLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish: Finish | None = None

    def add(self, piece: Piece) -> tuple[str, list[int]]:
        """-> the piece's text and its bytes' offsets in the choice's text."""
        text, offsets = self.text.feed(piece.data, final=piece.finish is not None)
        self.parts.append(text)
        self.logprobs += piece.logprobs
        self.offsets += offsets
        self.finish = piece.finish
        return text, offsets


class _Shape(ABC):
    """How a route writes its choices: the completions shape or the chat shape."""

    def __init__(self, run: Run, req: CompletionRequest | ChatCompletionRequest) -> None:
        self.run, self.req = run, req
        self.created = int(time.time())
        self.model = run.job.model.name
        prefix = "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"

    def start(self) -> _Choice:
        return _Choice(Text())

    @abstractmethod
    def chunk(self, piece: Piece, text: str, offsets: list[int], first: bool) -> Any:
        """The choice of one stream chunk."""

    @abstractmethod
    def choice(self, index: int, c: _Choice) -> Any:
        """A choice of the whole response."""

    @abstractmethod
    def response(self, choices: list[Any], last: bool, stream: bool) -> BaseModel:
        """The whole response (`last`), or a chunk of a stream."""

    def extras(self, last: bool) -> dict[str, Any]:
        """What the response, or the last chunk of a stream, carries beside its choices."""
        if not last:
            return {}
        usage = not self.req.stream or (self.req.stream_options or {}).get("include_usage")
        return {  # the last chunk of a stream carries them too: a chunk has no other place
            "usage": self.run.usage() if usage else None,
            "seed": self.run.job.seed,
            "timings": self.run.timings(),
        }


class _CompletionShape(_Shape):
    req: CompletionRequest

    def _echo(self, first: bool) -> str:
        return self.run.prompt.decode("utf-8", "replace") if self.req.echo and first else ""

    def start(self) -> _Choice:
        return _Choice(Text(offset=len(self._echo(True))))

    def _logprobs(self, lps: list[ByteLogprob], offsets: list[int]) -> CompletionLogprobs | None:
        top = self.run.top_logprobs
        if top is None:
            return None
        return CompletionLogprobs(
            tokens=[byte_token(lp.byte) for lp in lps],
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{byte_token(b): v for b, v in lp.top} for lp in lps] if top else None,
            text_offset=offsets,
        )

    def chunk(self, piece: Piece, text: str, offsets: list[int], first: bool) -> Any:
        return CompletionChoice(
            text=self._echo(first) + text,
            index=piece.index,
            logprobs=self._logprobs(piece.logprobs, offsets),
            finish_reason=piece.finish,
        )

    def choice(self, index: int, c: _Choice) -> Any:
        return CompletionChoice(
            text=self._echo(True) + "".join(c.parts),
            index=index,
            logprobs=self._logprobs(c.logprobs, c.offsets),
            finish_reason=c.finish,
        )

    def response(self, choices: list[Any], last: bool, stream: bool) -> BaseModel:
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, **self.extras(last)
        )


class _ChatShape(_Shape):
    req: ChatCompletionRequest

    def _logprobs(self, lps: list[ByteLogprob]) -> ChatLogprobs | None:
        if self.run.top_logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                TokenLogprob(
                    token=byte_token(lp.byte),
                    logprob=lp.logprob,
                    bytes=[lp.byte],
                    top_logprobs=[
                        TopLogprob(token=byte_token(b), logprob=v, bytes=[b]) for b, v in lp.top
                    ],
                )
                for lp in lps
            ]
        )

    def chunk(self, piece: Piece, text: str, offsets: list[int], first: bool) -> Any:
        return ChunkChoice(
            index=piece.index,
            delta=Delta(role="assistant" if first else None, content=text),
            logprobs=self._logprobs(piece.logprobs),
            finish_reason=piece.finish,
        )

    def choice(self, index: int, c: _Choice) -> Any:
        assert c.finish is not None  # every choice has finished
        return ChatChoice(
            index=index,
            message=ChatMessage(content="".join(c.parts)),
            logprobs=self._logprobs(c.logprobs),
            finish_reason=c.finish,
        )

    def response(self, choices: list[Any], last: bool, stream: bool) -> BaseModel:
        cls = ChatChunk if stream else ChatCompletion
        return cls.model_validate(
            {
                "id": self.id,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **self.extras(last),
            }
        )


async def _respond(shape: _Shape, receive: Receive) -> BaseModel | Response:
    """Run the request's choices: the whole response (stopped if the client hangs up first),
    or a stream of chunks."""
    run, req = shape.run, shape.req
    log.info(
        "%s: model %s, n = %d, %d prompt bytes, user %s",
        shape.id,
        shape.model,
        run.n,
        len(run.prompt),
        req.user or "-",
    )
    pieces = run.pieces()
    choices = [shape.start() for _ in range(run.n)]
    if not req.stream:

        async def collect() -> None:
            async for piece in pieces:
                choices[piece.index].add(piece)

        try:
            await while_connected(receive, collect())
        except ClientGone:
            return Response(status_code=CLIENT_GONE)  # nobody reads it
        finally:
            await pieces.aclose()
            run.done()
        whole = [shape.choice(i, c) for i, c in enumerate(choices)]
        return shape.response(whole, last=True, stream=False)

    async def release() -> None:
        await pieces.aclose()
        run.done()

    # The first piece is computed before the response starts, so that a chain that is down
    # answers with a proper status rather than a stream that breaks at once.
    try:
        first = await anext(pieces)
    except BaseException:
        await release()
        raise
    finished = 0

    def event(piece: Piece) -> str:
        nonlocal finished
        c = choices[piece.index]
        opening = not c.parts
        text, offsets = c.add(piece)
        finished += piece.finish is not None
        chunk = shape.chunk(piece, text, offsets, opening)
        return f"data: {shape.response([chunk], finished == run.n, True).model_dump_json()}\n\n"

    async def events() -> AsyncGenerator[str]:
        yield event(first)
        try:
            async for piece in pieces:
                yield event(piece)
        except ServingError as exc:
            err = run.router.failed(exc)
            log.warning("stream %s failed: %s", shape.id, err.message)
            yield f"data: {json.dumps(err.to_json())}\n\n"
            return
        yield "data: [DONE]\n\n"

    return _Stream(events(), run, release, run.router.settings)


def add_openai_routes(app: FastAPI, router: Router) -> None:
    """POST /v1/completions and POST /v1/chat/completions on `app`."""

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> BaseModel | Response:
        arrived = time.perf_counter()
        client, address = holder_of(request.scope)
        if req.echo and req.logprobs is not None:
            raise BadRequest(
                "echo with logprobs asks for the prompt's logprobs, which this router does not "
                "compute; ask for one or the other",
                param="logprobs",
            )
        run = await start_run(
            router,
            req,
            prompt=req.prompt,
            n_bytes=req.max_tokens,
            param="max_tokens",
            top_logprobs=req.logprobs,
            arrived=arrived,
            client=client,
            address=address,
        )
        return await _respond(_CompletionShape(run, req), request.receive)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> BaseModel | Response:
        arrived = time.perf_counter()
        client, address = holder_of(request.scope)
        run = await start_run(
            router,
            req,
            prompt=chat_prompt(req.messages),
            n_bytes=req.budget(),
            param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
            top_logprobs=req.top(),
            arrived=arrived,
            client=client,
            address=address,
        )
        return await _respond(_ChatShape(run, req), request.receive)
