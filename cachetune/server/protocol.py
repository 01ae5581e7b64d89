"""The HTTP bodies: OpenAI's chat and completion requests with cachetune's extras, and the document API.

Extras (ignored by other servers, passed by the `openai` client through `extra_body`):
- `documents`: chunks placed, in the given order, before the conversation (in the first user message)
  or before the completion prompt. Each is a document id from POST /v1/documents (32 hex digits), an
  object {"id": ...}, an inline text (registered on first sight), or an object {"text": ...}.
- `method`, `ratio`: the prefill method (cachetune.methods) and its recompute share, a number or
  "auto" (the ratio calibrated for the tier the documents are read from; see `cachetune calibrate`).
- `ignore_eos`: decode max_tokens tokens whatever the model says (benchmarks).

Types are strict (`true` is not 1, `"3"` is not 3), and `null` means the field's default, as in
OpenAI's API. Fields the server cannot honour (n > 1, best_of > 1, suffix, tools, penalties,
logit_bias, a JSON response_format) are refused by name, never silently dropped; fields it does
not know are ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cachetune.runtime.decode import MAX_TOP_LOGPROBS

DOCUMENT_ID = re.compile(r"[0-9a-f]{32}")  # a chunk id (chunks.encode.chunk_id); never a path
NOT_SERVED = {  # OpenAI fields the server does not implement -> why a request that turns them on is refused
    "presence_penalty": "penalties are not served", "frequency_penalty": "penalties are not served",
    "logit_bias": "logit_bias is not served", "response_format": "only response_format {'type': 'text'} is served",
    "tools": "tool calls are not served (tool-call history in messages is)", "functions": "functions are not served",
    "best_of": "only best_of = 1 is served", "suffix": "suffix is not served"}
STRICT = ConfigDict(strict=True, extra="ignore")


def is_document_id(text: str) -> bool:
    return bool(DOCUMENT_ID.fullmatch(text))


class DocumentById(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str

    @field_validator("id")
    @classmethod
    def _an_id(cls, value: str) -> str:
        if not is_document_id(value):
            raise ValueError("a document id is 32 lowercase hex digits")
        return value


class DocumentByText(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    text: str = Field(min_length=1)


DocumentRef = Union[Annotated[str, Field(min_length=1)], DocumentById, DocumentByText]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message. Assistant turns may carry `tool_calls` (content then may be null) and `tool`
    messages their results: history rendered through the model's chat template, as text."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class GenerationFields(BaseModel):
    """What chat and completion requests share (OpenAI's names and defaults, plus the extras)."""

    model_config = STRICT

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # None: 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None        # None: 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    documents: list[DocumentRef] | None = None
    method: str | None = Field(None, min_length=1)
    ratio: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] | None = None
    ignore_eos: bool | None = None

    # Accepted only at their "off" value (NOT_SERVED).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    tools: list | None = None
    functions: list | None = None

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools", "functions")
    @classmethod
    def _not_served(cls, value, info: ValidationInfo):
        off = not value or (info.field_name == "response_format" and value.get("type") == "text")
        if not off:
            raise ValueError(NOT_SERVED[info.field_name])
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
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

    @property
    def document_refs(self) -> list:
        return self.documents or []


TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    prompt_field: ClassVar[str] = "messages"  # where errors about the prompt point

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_top(self) -> int | None:
        """Top alternatives per generated token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(GenerationFields):
    """A text completion; `prompt` is a text, token ids, or a list of either (one choice each)."""

    prompt: Annotated[str, Field(min_length=1)] | TokenIds | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                                        Field(min_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: OpenAI's default of 16
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    prompt_field: ClassVar[str] = "prompt"

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(NOT_SERVED["best_of"])
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(NOT_SERVED["suffix"])
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids (a single prompt is a list of one)."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    @property
    def new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def logprobs_top(self) -> int | None:
        return self.logprobs


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    texts: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
