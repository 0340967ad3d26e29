"""OpenAI request and response shapes (the subset this server speaks), as pydantic models.

Requests ignore fields they do not know (SDKs send more than we use); what
they do carry is validated, so bad values become 400s in OpenAI's error shape.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from server.api.common import (
    SEED_RANGE,
    SESSION_ID_PATTERN,
    CacheOptions,
    KeepAlive,
    Request,
    TextRequest,
    json_text,
    object_schema,
)
from server.engine.jobs import SamplingParams

MAX_CHOICES = 8  # n at most: each choice decodes as a row beside the request's first


# ----------------------------------------------------------------------- requests


class StreamOptions(Request):
    include_usage: bool = False


class SamplingRequest(TextRequest):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    prompt_cache_key: str | None = Field(None, pattern=SESSION_ID_PATTERN)
    kv_cache: CacheOptions | None = None
    # This server's extension: drafts verified in one pass (docs/speculation.md); None: the
    # server's --draft-max.
    speculation: bool | None = None
    keep_alive: KeepAlive = None  # this server's extension: seconds its model stays loaded

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v and any(not -100 <= b <= 100 for b in v.values()):
            raise ValueError("logit_bias values must lie in [-100, 100]")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, v: StreamOptions | None, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def prompt_logprobs(self) -> bool:
        """Whether the prompt's own tokens' logprobs are asked for (completions' echo)."""
        return False

    def predicted(self) -> str | None:
        """The reply's predicted text (chat completions' `prediction`)."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """This request's sampling, with the reply length the server settled on."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed % 2**64,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            logprobs=self.n_logprobs(),
            prompt_logprobs=self.prompt_logprobs(),
            speculation=self.speculation,
            prediction=self.predicted(),
        )


FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionCall(Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _decodes_to_text(cls, v: str) -> str:
        return json_text(v)


class ToolCall(Request):
    """An earlier reply's call, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def arguments(self) -> Any:
        """The arguments as JSON values (a template renders them), or the text if not JSON."""
        try:
            return json.loads(self.function.arguments)
        except json.JSONDecodeError:
            return self.function.arguments


class FunctionDefinition(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict[str, Any]) -> dict[str, Any]:
        return object_schema(v, "parameters")


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    def text(self) -> str:
        """Content as plain text (the text parts of a multi-part message)."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


def _unsupported(field: str, why: str, harmless: tuple = (None,)):
    """A validator refusing `field` with a 400 that names it, instead of ignoring it.

    Values in `harmless` (no tools, tool_choice "none") ask for nothing and pass.
    """

    def check(cls, v):
        if v not in harmless:
            raise ValueError(f"{field} is not supported: {why}")
        return v

    return field_validator(field)(classmethod(check))


LEGACY_FUNCTIONS = "use tools and tool_choice (functions and function_call are deprecated)"


class JsonSchemaFormat(Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    """`text`, `json_object` (any JSON object) or `json_schema` (server/api/structured.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs its json_schema object")
        return self


class TextPart(Request):
    type: Literal["text"]
    text: str


class Prediction(Request):
    """OpenAI's Predicted Outputs: text the reply is expected to repeat (a file being
    edited). Its tokens feed speculative decoding's drafts (docs/speculation.md)."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    prediction: Prediction | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Thinking models: "none" switches the template's thinking off (enable_thinking).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: to the chat template
    # Refused rather than ignored: a client that sends them expects them honoured.
    functions: Any = None
    function_call: Any = None
    _no_functions = _unsupported("functions", LEGACY_FUNCTIONS, (None, []))
    _no_function_call = _unsupported("function_call", LEGACY_FUNCTIONS, (None, "none"))

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        for m in self.messages:
            m.text()  # rejects non-text parts early
        return self

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) < len(names):
            raise ValueError("two functions have the same name")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _known_tool(cls, v, info: ValidationInfo):
        names = [t.function.name for t in info.data.get("tools") or []]
        if v not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"names {v.function.name!r}, which is not in tools")
        return v

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def n_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def predicted(self) -> str | None:
        return self.prediction.text() if self.prediction else None

    def thinking(self) -> bool | None:
        """The template's thinking switch: off for effort "none", on for any other effort,
        the template's default (or chat_template_kwargs') when no effort is given."""
        return None if self.reasoning_effort is None else self.reasoning_effort != "none"


MAX_PROMPTS = 32  # prompts in one /v1/completions request at most (a choice each)


class CompletionRequest(SamplingRequest):
    # A text, token ids, or a batch of either: one choice (n of them) per prompt.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    _no_suffix = _unsupported("suffix", "this server does not fill in the middle")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        batch = v if isinstance(v, list) and v and isinstance(v[0], str | list) else [v]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"takes at most {MAX_PROMPTS} prompts in one request")
        if any(len(p) == 0 for p in batch):
            raise ValueError("a prompt is empty")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(
                "best_of is not supported: this server returns every choice it samples (n)"
            )
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or token ids."""
        v = self.prompt
        return list(v) if isinstance(v, list) and isinstance(v[0], str | list) else [v]

    def token_limit(self) -> int | None:
        return self.max_tokens or 16  # OpenAI's default for completions

    def n_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None


# ---------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens reused from the conversation's cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # a thinking model's reply tokens spent thinking
    # Speculative decoding's drafted tokens the model took and refused (OpenAI reports its
    # Predicted Outputs here: the same thing).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(
        cls,
        prompt: int,
        completion: int,
        cached: int,
        reasoning: int | None = None,
        drafts: tuple[int, int] = (0, 0),
    ) -> Usage:
        """`drafts`: speculative decoding's (accepted, rejected) drafted tokens."""
        details = None
        if reasoning is not None or any(drafts):
            details = CompletionTokensDetails(
                reasoning_tokens=reasoning or 0,
                accepted_prediction_tokens=drafts[0],
                rejected_prediction_tokens=drafts[1],
            )
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            completion_tokens_details=details,
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]
    refusal: None = None


class TextLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length", "tool_calls"] | None


class Envelope(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[dict] | None = None  # [{id, type: function, function: {name, arguments}}]
    reasoning_content: str | None = None  # a thinking model's reasoning (sent only then)

    @model_serializer(mode="wrap")
    def _reasoning_when_any(self, handler):
        out = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A stream chunk's delta: only the fields it carries are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None  # [{index, id, type, function: {name, arguments}}]

    @model_serializer(mode="wrap")
    def _without_nones(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # sent (null until the last chunk) only with include_usage


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: TextLogprobs | None = None
    finish_reason: FinishReason = None


class Completion(Envelope):
    """/v1/completions, whole or as stream chunks (the same object name for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage | None = None
