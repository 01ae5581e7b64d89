"""The HTTP bodies: OpenAI's chat and completion requests with cachetune's extras, and the document API.

Extras (ignored by other servers, passed by the `openai` client through `extra_body`):
- `documents`: chunks placed, in the given order, before the conversation (in the first user message)
  or before the completion prompt. Each is a document id from POST /v1/documents (32 hex digits), an
  object {"id": ...}, an inline text (registered on first sight), or an object {"text": ...}.
- `method`, `ratio`: the prefill method (cachetune.methods) and its recompute share, a number or
  "auto" (the ratio calibrated for the tier the documents are read from; see `cachetune calibrate`).
- `ignore_eos`: decode max_tokens tokens whatever the model says (benchmarks).
Fields the server cannot honour (n > 1, logprobs, tools, penalties, logit_bias, a JSON response_format)
are refused by name, never silently dropped; fields it does not know are ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DOCUMENT_ID = re.compile(r"^[0-9a-f]{32}$")  # a chunk id (chunks.encode.chunk_id); never a path
NOT_SERVED = {  # OpenAI fields the server does not implement -> why a request that turns them on is refused
    "presence_penalty": "penalties are not served", "frequency_penalty": "penalties are not served",
    "logit_bias": "logit_bias is not served", "response_format": "only response_format {'type': 'text'} is served",
    "tools": "tool calls are not served", "echo": "echo is not served", "logprobs": "logprobs are not served"}


def is_document_id(text: str) -> bool:
    return bool(DOCUMENT_ID.match(text))


class DocumentById(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str

    @field_validator("id")
    @classmethod
    def _an_id(cls, value: str) -> str:
        if not is_document_id(value):
            raise ValueError("a document id is 32 lowercase hex digits")
        return value


class DocumentByText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1)


DocumentRef = Union[str, DocumentById, DocumentByText]


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class GenerationFields(BaseModel):
    """What chat and completion requests share (OpenAI's names and defaults, plus the extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    documents: list[DocumentRef] = Field(default_factory=list)
    method: str | None = Field(None, min_length=1)
    ratio: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] | None = None
    ignore_eos: bool = False

    # Accepted only at their "off" value (NOT_SERVED).
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    tools: list | None = None
    echo: bool = False

    @field_validator(*NOT_SERVED)
    @classmethod
    def _not_served(cls, value, info: ValidationInfo):
        off = not value or (info.field_name == "response_format" and value.get("type") == "text")
        if not off:
            raise ValueError(NOT_SERVED[info.field_name])
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n = 1 is served")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationFields):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("one prompt per request")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] = Field(min_length=1)

    @field_validator("texts")
    @classmethod
    def _nonempty(cls, texts: list[str]) -> list[str]:
        for i, text in enumerate(texts):
            if not text:
                raise ValueError(f"texts[{i}] is empty")
        return texts
