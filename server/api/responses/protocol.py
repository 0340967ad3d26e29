"""OpenAI's Responses API as pydantic models: the request, its input items and tools, the
Response object, its output items and the stream's events, field by field as OpenAI's
spec names them (the `openai` package's types are the tests' oracle).

Requests ignore fields they do not know (clients send more than the spec: Codex's
`client_metadata`); what they carry is validated, so a bad value is a 400 in OpenAI's
shape. Items and content parts are unions on `type`: an unknown type, or one this server
cannot read (an image for a text-only model, a hosted tool's call), is a 400 naming it.
Tools are different: a tool the server cannot run is left out, never a failed request
(server/api/responses/turn.py says which, and the reply carries it).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from server.api.common import (
    SESSION_ID_PATTERN,
    CacheOptions,
    KeepAlive,
    Request,
    TextRequest,
    json_text,
    object_schema,
)

ROLES = ("user", "assistant", "system", "developer")
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # the spec's function names (no dots: see turn.py)


def _tagged(value: Any, known: tuple[str, ...], default: str | None = None) -> str:
    """The union member for `value`: its `type` if known, else "type" (the loc a 400 names)."""
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in known else "type"


class Unsupported(Request):
    """What a union does not take: a 400 that names the type (and why, if known)."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None
    why: ClassVar[dict[str, str]] = {}

    @model_validator(mode="after")
    def _refused(self) -> Unsupported:
        if self.type is None:
            raise ValueError("needs a type")
        why = self.why.get(self.type)
        raise ValueError(f"{self.type!r} {why}" if why else f"unknown type {self.type!r}")


# ------------------------------------------------------------------ content parts

TEXT_ONLY = "is not supported: this server's model reads text only"


class InputText(Request):
    type: Literal["input_text"]
    text: str


class OutputText(Request):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)


class Refusal(Request):
    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(Unsupported):
    why = {"input_image": TEXT_ONLY, "input_file": TEXT_ONLY, "input_audio": TEXT_ONLY}


PART_TYPES = ("input_text", "output_text", "refusal")
Part = Annotated[
    Annotated[InputText, Tag("input_text")]
    | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")]
    | Annotated[UnsupportedPart, Tag("type")],
    Discriminator(lambda v: _tagged(v, PART_TYPES)),
]


def part_text(part: InputText | OutputText | Refusal) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


# ------------------------------------------------------------------ tools


class FunctionTool(Request):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return object_schema(v, "parameters")

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class OtherTool(Request):
    """A tool this server does not run (web_search, file_search, mcp, custom, ...): kept as
    sent, so the reply can echo it and say it was left out."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None
    server_label: str | None = None  # an MCP server's

    def label(self) -> str:
        named = self.name or self.server_label
        return f"{self.type}:{named}" if named else self.type


NamespaceMember = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("type")],
    Discriminator(lambda v: _tagged(v, ("function",))),
]


class NamespaceTool(Request):
    """A group of functions under one name; a call to one names the namespace."""

    type: Literal["namespace"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    tools: list[NamespaceMember]


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[OtherTool, Tag("type")],
    Discriminator(lambda v: _tagged(v, ("function", "namespace"))),
]


# ------------------------------------------------------------------ input items


class MessageItem(Request):
    """A message in the input: `content` a string or parts (a string becomes one part)."""

    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: list[Part]
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _string_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), str):
            kind = "output_text" if data.get("role") == "assistant" else "input_text"
            return {**data, "content": [{"type": kind, "text": data["content"]}]}
        return data

    def text(self) -> str:
        return "".join(part_text(p) for p in self.content)


class FunctionCallItem(Request):
    """An earlier reply's call of a function (a namespace's: `namespace` names it)."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("arguments")
    @classmethod
    def _decodes_to_text(cls, v: str) -> str:
        return json_text(v)


class FunctionCallOutputItem(Request):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str | list[Part]
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part_text(p) for p in self.output)


class ReasoningSummary(Request):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Request):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Request):
    """An earlier reply's reasoning: its text goes back to the template beside the reply it
    led to (which renders or drops it); `encrypted_content` is accepted and unread."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningSummary] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        parts = self.content or self.summary  # the full reasoning if given, else its summary
        return "\n".join(p.text for p in parts)


class CustomToolCallItem(Request):
    """A freeform tool's call from another server's history (this one never offers them)."""

    type: Literal["custom_tool_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str


class CustomToolCallOutputItem(Request):
    type: Literal["custom_tool_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str | list[Part]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part_text(p) for p in self.output)


class ItemReference(Request):
    """An item of this response's chain, by id (resolved from the stored history)."""

    type: Literal["item_reference"] = "item_reference"
    id: str


class AdditionalToolsItem(Request):
    """Tools given among the input (Codex, under a model name it knows): offered like `tools`."""

    type: Literal["additional_tools"]
    id: str | None = None
    role: str = "developer"
    tools: list[Tool]


HOSTED_CALL = "is a hosted tool's item; this server runs no hosted tools"


class UnsupportedItem(Unsupported):
    why = dict.fromkeys(
        (
            "web_search_call", "file_search_call", "computer_call", "computer_call_output",
            "image_generation_call", "code_interpreter_call", "local_shell_call",
            "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
            "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
            "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output",
            "program", "program_output", "compaction", "compaction_trigger",
        ),
        HOSTED_CALL,
    )  # fmt: skip


ITEM_TYPES = (
    "message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
    "custom_tool_call_output", "item_reference", "additional_tools",
)  # fmt: skip
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ItemReference, Tag("item_reference")]
    | Annotated[AdditionalToolsItem, Tag("additional_tools")]
    | Annotated[UnsupportedItem, Tag("type")],
    # An item without a type is a message (EasyInputMessage), or a reference if it has
    # only an id.
    Discriminator(
        lambda v: _tagged(
            v,
            ITEM_TYPES,
            "item_reference" if isinstance(v, dict) and set(v) == {"id"} else "message",
        )
    ),
]


class FunctionChoice(Request):
    type: Literal["function"]
    name: str


class AllowedTools(Request):
    """`allowed_tools`: the model may call only these of `tools` (functions by name)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class OtherChoice(Request):
    """A hosted tool, a custom or an MCP tool forced: this server runs none (a 400)."""

    model_config = ConfigDict(extra="allow")
    type: str


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[FunctionChoice, Tag("function")]
    | Annotated[AllowedTools, Tag("allowed_tools")]
    | Annotated[OtherChoice, Tag("type")],
    Discriminator(
        lambda v: "mode" if isinstance(v, str) else _tagged(v, ("function", "allowed_tools"))
    ),
]


# ------------------------------------------------------------------ request


class TextFormat(Request):
    """`text.format`: `text`, `json_object` (any JSON object) or `json_schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a json_schema format needs its name and schema")
        return self

    @model_serializer(mode="wrap")
    def _as_sent(self, handler):
        out = handler(self)
        if "schema_" in out:
            out["schema"] = out.pop("schema_")
        return {k: v for k, v in out.items() if v is not None or k == "type"}


class TextConfig(Request):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not read


class ReasoningConfig(Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: no summaries


NOT_SUPPORTED = "is not supported by this server"


class ResponseCreate(TextRequest):
    """POST /v1/responses."""

    model: str
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    prompt_cache_key: str | None = Field(None, pattern=SESSION_ID_PATTERN)
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: --default-temperature
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    reasoning: ReasoningConfig | None = None
    include: list[str] = Field(default_factory=list)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    kv_cache: CacheOptions | None = None  # this server's extension, as in chat completions
    speculation: bool | None = None  # the same
    keep_alive: KeepAlive = None  # the same
    # Accepted and not read (docs/api.md says why each is harmless):
    # stream_options, service_tier, truncation, top_logprobs, max_tool_calls,
    # prompt_cache_retention, prompt_cache_options, context_management, client_metadata.
    # Refused: a client that sends them expects what this server does not do.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    @model_validator(mode="before")
    @classmethod
    def _text_input(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("input"), str):
            return {
                **data,
                "input": [{"type": "message", "role": "user", "content": data["input"]}],
            }
        return data

    @field_validator("background")
    @classmethod
    def _not_background(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError(
                f"background {NOT_SUPPORTED}: every response runs while its request waits"
            )
        return v

    @field_validator("conversation", "prompt")
    @classmethod
    def _not_given(cls, v: Any, info) -> Any:
        if v is not None:
            why = {
                "conversation": "continue a conversation with previous_response_id",
                "prompt": "prompt templates live on OpenAI's platform; send input",
            }[info.field_name]
            raise ValueError(f"{info.field_name} {NOT_SUPPORTED}: {why}")
        return v

    def thinking(self) -> bool | None:
        """The template's thinking switch: off for effort "none", on for any other, the
        template's default without an effort."""
        effort = self.reasoning.effort if self.reasoning else None
        return None if effort is None else effort != "none"


class InputTokensCount(ResponseCreate):
    """POST /v1/responses/input_tokens: the input a create would prefill, counted."""

    model: str | None = None  # the served model's


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class InputItemsQuery(Request):
    """GET /v1/responses/{id}/input_items: a cursor page."""

    after: str | None = None
    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"


# ------------------------------------------------------------------ the Response object

Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextOut(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextOut(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputTextOut]


class ReasoningOut(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)  # this server writes no summaries
    content: list[ReasoningTextOut]
    encrypted_content: None = None  # nothing is encrypted: the text is in `content`
    status: ItemStatus


class FunctionCallOut(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # sent only for a namespace's function

    @model_serializer(mode="wrap")
    def _namespace_when_any(self, handler):
        out = handler(self)
        if out.get("namespace") is None:
            out.pop("namespace", None)
        return out


OutputItem = MessageOut | ReasoningOut | FunctionCallOut


class InputTokensDetails(BaseModel):
    cached_tokens: int  # input tokens reused from the chain's (or the key's) cache
    cache_write_tokens: int  # input tokens prefilled into it this time


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(
        cls, prompt: int, completion: int, cached: int, reasoning: int, kept: bool = True
    ) -> ResponseUsage:
        """`kept`: the session's cache outlives the reply (what was prefilled was written)."""
        return cls(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(
                cached_tokens=cached, cache_write_tokens=prompt - cached if kept else 0
            ),
            output_tokens=completion,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=prompt + completion,
        )


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """The Response: what POST answers, GET returns and the stream's events carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: ReasoningConfig
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool
    temperature: float
    text: TextConfig
    tool_choice: Any
    tools: list[Any]  # the tools offered to the model (those left out: X-Tools-Not-Offered)
    top_p: float
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# ------------------------------------------------------------------ stream events


class Event(BaseModel):
    type: str
    sequence_number: int


class ResponseEvent(Event):
    """response.created, .in_progress, .completed, .incomplete, .failed."""

    response: ResponseObject


class ItemEvent(Event):
    """response.output_item.added and .done."""

    output_index: int
    item: OutputItem


class _ContentEvent(Event):
    """An event about one content part of an output item."""

    item_id: str
    output_index: int
    content_index: int


class PartEvent(_ContentEvent):
    """response.content_part.added and .done."""

    part: OutputTextOut | ReasoningTextOut


class _TextPartEvent(_ContentEvent):
    """An output_text or reasoning_text event: logprobs only for output_text (none are
    sent: an empty list), as reasoning_text events have no such field."""

    logprobs: list[Any] | None = None

    @model_serializer(mode="wrap")
    def _logprobs_for_text(self, handler):
        out = handler(self)
        if out["logprobs"] is None:
            del out["logprobs"]
        return out


class TextDeltaEvent(_TextPartEvent):
    """response.output_text.delta and response.reasoning_text.delta."""

    delta: str


class TextDoneEvent(_TextPartEvent):
    """response.output_text.done and response.reasoning_text.done."""

    text: str


class ArgumentsDeltaEvent(Event):
    """response.function_call_arguments.delta."""

    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Event):
    """response.function_call_arguments.done."""

    item_id: str
    output_index: int
    name: str
    arguments: str
