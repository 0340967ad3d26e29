"""Anthropic's Messages API shapes (the part this server speaks), as pydantic models named
field by field as Anthropic names them (its API reference; the `anthropic` SDK's types are
the tests' oracle).

Requests ignore fields they do not know (Claude Code sends betas' fields every release);
what they carry is validated, so bad values are 400s in Anthropic's error shape
(server/api/errors.py). docs/api.md (POST /v1/messages) says, field by field, what is
honoured and what is accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
    CacheOptions,
    KeepAlive,
    Request,
    TextRequest,
    object_schema,
)

# ----------------------------------------------------------------------- content blocks


class CacheControl(Request):
    """Prompt-caching breakpoints: accepted, not needed (every conversation keeps its
    whole cache, server/sessions/store.py)."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


class TextBlock(Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # accepted, ignored


class ImageBlock(Request):
    type: Literal["image"]
    source: dict[str, Any]  # base64, url or file: never read (no model here sees images)
    cache_control: CacheControl | None = None


class DocumentBlock(Request):
    """A document: its text when its source is plain text (`{"type": "text", "data"}`)."""

    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str | None:
        """The document as text, or None for a source only a multimodal model reads (PDF)."""
        source = self.source
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            return "\n\n".join(t for t in (self.title, self.context, source["data"]) if t)
        if source.get("type") == "content" and isinstance(source.get("content"), str):
            return source["content"]
        return None


class ToolUseBlock(Request):
    """An earlier reply's call, sent back in the history."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Discriminator("type")]


class ToolResultBlock(Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(Request):
    """An earlier reply's reasoning: given back to templates that render it."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # this server signs nothing: "" (or whatever came) is taken back


class RedactedThinkingBlock(Request):
    """Encrypted reasoning from Anthropic's own models: nothing a local model can read."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Discriminator("type"),
]
BLOCK_TYPES = (
    "text",
    "image",
    "document",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
)
# Blocks of Anthropic's server tools (and its containers): the results of tools that run
# on Anthropic's side, which this server never produces nor runs.
SERVER_BLOCK_TYPES = (
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
    "search_result",
)


def _check_block_types(content: Any) -> None:
    """A clear 400 for a block type this server does not take, before the union's own."""
    if not isinstance(content, list):
        return
    if not content:
        raise ValueError("content is an empty list: a turn holds a string or at least one block")
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in BLOCK_TYPES:
            continue
        if kind in SERVER_BLOCK_TYPES:
            raise ValueError(
                f"content[{j}] is a {kind!r} block, which belongs to Anthropic's server "
                "tools: this server runs none, so it cannot take their blocks back"
            )
        raise ValueError(
            f"content[{j}] has the unknown block type {kind!r}; this server takes "
            + ", ".join(BLOCK_TYPES)
        )


class InputMessage(Request):
    """One entry of `messages`: user and assistant turns, and the `system` entries Claude
    Code puts among them (its mid-conversation-system beta)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_block_types(data.get("content"))
        return data

    @model_validator(mode="after")
    def _system_is_text(self) -> InputMessage:
        if self.role == "system" and not isinstance(self.content, str):
            if any(b.type != "text" for b in self.content):
                raise ValueError("a system message holds text blocks only")
        return self

    def blocks(self) -> list:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


# ----------------------------------------------------------------------- tools

TOOL_NAME = r"^[A-Za-z0-9_.:-]{1,128}$"


class CustomTool(Request):
    """A tool the client runs, described by its input's JSON schema: offered to the model."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # tools are always generated valid: accepted, ignored

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, v: dict[str, Any]) -> dict[str, Any]:
        return object_schema(v, "input_schema")


class TypedTool(Request):
    """One of Anthropic's own tools (`web_search_20250305`, `bash_20250124`,
    `text_editor_...`, `code_execution_...`, `computer_...`, `memory_...`): their schemas
    are built into Anthropic's models, and server tools run on Anthropic's side. None is
    offered to the model; the reply's `X-Tools-Not-Offered` header names them."""

    type: str
    name: str | None = None

    def label(self) -> str:
        """As X-Tools-Not-Offered names it (the Responses door's way too): type:name."""
        return f"{self.type}:{self.name}" if self.name else self.type


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom" if kind in (None, "custom") else "typed"


ToolDefinition = Annotated[
    Annotated[CustomTool, Tag("custom")] | Annotated[TypedTool, Tag("typed")],
    Discriminator(_tool_kind),
]


class ToolChoiceAuto(Request):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Request):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Request):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Request):
    type: Literal["none"]
    disable_parallel_tool_use: bool = False  # never sent by the SDK; harmless


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Discriminator("type")
]


# ----------------------------------------------------------------------- the rest


class ThinkingConfig(Request):
    """`enabled` and `disabled` reach the template's switch (`enable_thinking`);
    `adaptive` (Claude Code's) leaves the template's default."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)  # accepted, not enforced
    display: str | None = None  # accepted, ignored (the reasoning is sent whole)


class JSONOutputFormat(Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Request):
    effort: str | None = None  # low / medium / high reach a template that takes them (Harmony)
    format: JSONOutputFormat | None = None  # the reply's text follows the schema


class Metadata(Request):
    user_id: str | None = None  # accepted, ignored (it names a user, not a conversation)


class PromptRequest(TextRequest):
    """What /v1/messages and /v1/messages/count_tokens share: everything that makes the
    prompt."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None  # the structured-outputs beta's name for it
    # Accepted and ignored (docs/api.md says why each is harmless):
    context_management: Any = None
    mcp_servers: Any = None
    cache_control: Any = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list | None) -> list | None:
        names = [t.name for t in v or [] if isinstance(t, CustomTool)]
        if len(set(names)) < len(names):
            raise ValueError("two tools have the same name")
        return v

    def answer_schema(self) -> dict | None:
        fmt = (self.output_config and self.output_config.format) or self.output_format
        return None if fmt is None else fmt.schema_


class ThreadParam(Request):
    """A message thread (server/api/messages/threads.py): `create` keeps the conversation
    under the reply's id; `continue` sends only the messages since `previous_message_id`."""

    type: Literal["create", "continue"]
    previous_message_id: str | None = None

    @model_validator(mode="after")
    def _continues_a_reply(self) -> ThreadParam:
        if self.type == "continue" and not self.previous_message_id:
            raise ValueError("a thread's continue names its previous_message_id")
        return self


class MessagesRequest(PromptRequest):
    # 0 is Anthropic's "pre-warm the cache": the prompt is prefilled, nothing is generated.
    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # None: Anthropic's 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    kv_cache: CacheOptions | None = None  # this server's extension, as in chat completions
    speculation: bool | None = None  # the same
    keep_alive: KeepAlive = None  # the same
    thread: ThreadParam | None = None
    # Accepted and ignored:
    service_tier: Any = None
    container: Any = None
    inference_geo: Any = None
    speed: Any = None

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not s for s in v):
            raise ValueError("a stop sequence is empty")
        return v


class CountTokensRequest(PromptRequest):
    pass


# ----------------------------------------------------------------------- replies


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing is signed here; clients send it back as they got it


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


BlockOut = TextOut | ThinkingOut | ToolUseOut


class OutputTokensDetails(BaseModel):
    thinking_tokens: int  # reply tokens spent inside the thinking block, its tags included


class Usage(BaseModel):
    """Anthropic's split of the prompt: `input_tokens` is what was prefilled for this
    request, `cache_read_input_tokens` what the conversation's cache (or a stored system
    prompt) already held; nothing is billed as a cache write, so
    `cache_creation_input_tokens` is 0. The three add up to the prompt's tokens."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens_details: OutputTokensDetails | None = None  # a thinking model's only

    @model_serializer(mode="wrap")
    def _details_when_thinking(self, handler):
        out = handler(self)
        if out.get("output_tokens_details") is None:
            out.pop("output_tokens_details", None)
        return out


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[BlockOut]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int


# ----------------------------------------------------------------------- stream events


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: BlockOut


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJSONDelta | ThinkingDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    """The end of the reply; its usage is the whole request's (cumulative, as Anthropic's)."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: Usage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail


Event = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
    | ErrorEvent
)


def sse(event: Event) -> dict:
    """An event as sse-starlette sends it: `event:` named by its type (Claude Code reads a
    stream without them as no stream at all), its data as JSON."""
    return {"event": event.type, "data": event.model_dump()}


# ----------------------------------------------------------------------- models


class ModelInfo(BaseModel):
    """GET /v1/models in Anthropic's shape (a request carrying `anthropic-version`)."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str  # RFC 3339


class ModelList(BaseModel):
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
