"""`POST /v1/chat/completions`: its request and response models and the byte-level chat template
(docs/serving.md, "The OpenAI API"). It promises a well-formed byte prompt and a one-line
reply; it does not promise that the reply answers anything."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blocktrain.serving.openai.schemas import MAX_TOP_LOGPROBS, OpenAIParams, Timings, Usage
from blocktrain.serving.shared.serving_errors import BadRequest

REPLY_PREFIX = "assistant: "
REPLY_STOP = "\n"
"""The reply is one line: it ends at the first newline."""
DEFAULT_REPLY_BYTES = 256


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"a byte-level model reads text parts only, not {kind!r}")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def chat_prompt(messages: list[Message]) -> str:
    """The template: `ROLE: CONTENT` per message, a line each, then the reply's prefix."""
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + REPLY_PREFIX


class ChatCompletionRequest(OpenAIParams):
    """POST /v1/chat/completions, as the OpenAI API defines it."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Bytes to generate at most (default 256); the reply usually ends sooner, at a newline."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """The newer name of max_tokens."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _one_budget(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_REPLY_BYTES

    def top(self) -> int | None:
        """None: no logprobs; k: each byte's and the k likeliest at it."""
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def stops(self) -> list[str]:
        return [*super().stops(), REPLY_STOP]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    seed: int
    """The seed of choice 0 (an extension)."""
    timings: Timings
    """An extension (serving.md)."""


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    seed: int | None = None
    timings: Timings | None = None
