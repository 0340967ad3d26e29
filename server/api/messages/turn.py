"""A Messages request as the engine's Turn (server/api/turns.py): Anthropic's blocks as
chat-template messages, its tools as Functions, its switches as the Turn's.

- `system` (a string or text blocks) and the `system` entries before the first turn are
  one system message, the conversation's shareable prefix; a `system` entry later on
  (Claude Code puts one after the first user turn) stays where it is, and where the
  template refuses a system message there, `folded` moves it into the user turn beside
  it (server/api/messages/routes.py retries with that).
- A user turn's `tool_result` blocks are `tool` messages (the call they answer as
  `tool_call_id`; `is_error` as an "Error: " lead), its text a user message; an
  assistant turn's `tool_use` blocks are its `tool_calls`, its `thinking` its
  `reasoning_content` (templates that show past reasoning render it; others drop it).
- Typed tools (Anthropic's own: web search, bash, text editor, ...) are not offered to
  the model; their names come back in the reply's X-Tools-Not-Offered header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.api.common import temperature_or_default
from server.api.errors import APIError
from server.api.messages.protocol import (
    CustomTool,
    DocumentBlock,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    PromptRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from server.api.structured import Function, template_call
from server.api.turns import Turn
from server.engine.jobs import SamplingParams

# The request fields a 400 names, where they differ from the engine's own words.
MESSAGES_PARAMS = {
    "parameters": "tools.{i}.input_schema",
    "answer": "output_config.format.schema",
    "max_tokens": "max_tokens",
}
TOOL_ERROR = "Error: "  # leads a tool_result's text when is_error is true
JOIN = "\n\n"  # between a turn's text blocks


@dataclass
class MessagesTurn:
    """The Turn, and what the request asked for that the Turn does not carry."""

    turn: Turn
    not_offered: list[str] = field(default_factory=list)  # typed tools left out: "type:name"
    prefill_only: bool = False  # max_tokens 0: the prompt is cached, nothing generated


def messages_turn(
    body: PromptRequest,
    model_name: str,
    key: str | None = None,
    owner: str = "",
    default_temperature: float | None = None,
) -> MessagesTurn:
    """`body` as a Turn; `model_name` names the served model in errors (an image block);
    `default_temperature` for a request that sends none."""
    custom = [t for t in body.tools or [] if isinstance(t, CustomTool)]
    not_offered = [t.label() for t in body.tools or [] if not isinstance(t, CustomTool)]
    choice, parallel = tool_choice(body, {t.name for t in custom}, not_offered)
    request = body if isinstance(body, MessagesRequest) else None
    max_tokens = None if request is None else request.max_tokens
    turn = Turn(
        model=body.model,
        messages=template_messages(body, model_name),
        sampling=sampling(request, default_temperature),
        max_tokens=max(max_tokens, 1) if max_tokens is not None else None,
        functions=[Function(t.name, t.description, t.input_schema) for t in custom],
        tool_choice=choice,
        parallel_tool_calls=parallel,
        answer=body.answer_schema(),
        thinking=thinking(body),
        effort=body.output_config.effort if body.output_config else None,
        session_key=key,
        owner=owner,
        kv_cache=request.kv_cache if request else None,
        keep_alive=request.keep_alive if request else None,
        clamp_max_tokens=True,
        params=MESSAGES_PARAMS,
    )
    return MessagesTurn(turn, not_offered, prefill_only=max_tokens == 0)


def sampling(body: MessagesRequest | None, default_temperature: float | None) -> SamplingParams:
    """The request's sampling; its max_tokens is settled by turns.job."""
    if body is None:  # count_tokens: nothing is sampled
        return SamplingParams(max_tokens=1)
    return SamplingParams(
        max_tokens=1,
        temperature=temperature_or_default(body.temperature, default_temperature),
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=body.top_k or 0,
        stop=list(body.stop_sequences or []),
        speculation=body.speculation,
    )


def thinking(body: PromptRequest) -> bool | None:
    """The template's thinking switch: on for `enabled`, off for `disabled`, the
    template's default otherwise (`adaptive`, or no `thinking`)."""
    kind = body.thinking.type if body.thinking else None
    return {"enabled": True, "disabled": False}.get(kind)


def tool_choice(body: PromptRequest, names: set[str], not_offered: list[str]) -> tuple[str, bool]:
    """(the Turn's tool_choice, whether calls may come in parallel)."""
    choice = body.tool_choice
    parallel = not (choice and choice.disable_parallel_tool_use)
    if choice is None or isinstance(choice, ToolChoiceNone):
        return ("none" if choice else "auto"), parallel
    if isinstance(choice, ToolChoiceTool):
        if choice.name not in names:
            typed = {label.partition(":")[2] for label in not_offered}
            why = (
                "is one of Anthropic's own tools, which this server does not offer"
                if choice.name in typed
                else "is not in tools"
            )
            message = f"tool_choice names {choice.name!r}, which {why}"
            raise APIError(400, message, param="tool_choice")
        return choice.name, parallel
    if not isinstance(choice, ToolChoiceAny):
        return "auto", parallel  # (with no tool offered: a reply of text)
    if not names:
        left = f" (not offered: {', '.join(not_offered)})" if not_offered else ""
        message = f"tool_choice 'any' needs a tool the model is offered{left}"
        raise APIError(400, message, param="tool_choice")
    return "required", parallel


# ---------------------------------------------------------------------- messages


def template_messages(body: PromptRequest, model_name: str) -> list[dict]:
    """The chat-template messages of the request: one system message first (the `system`
    field and any system entries before the first turn), then the turns in order."""
    messages = body.messages
    first = 0  # the first turn that is not a system entry
    while first < len(messages) and messages[first].role == "system":
        first += 1
    lead = [_text(body.system)] if body.system else []
    lead += [_text(m.content) for m in messages[:first]]
    out = [{"role": "system", "content": JOIN.join(lead)}] if lead else []
    calls: set[str] = set()  # the ids of the calls the next user turn may answer
    for at in range(first, len(messages)):
        m = messages[at]
        if m.role == "system":
            out.append({"role": "system", "content": _text(m.content)})
        elif m.role == "assistant":
            out.append(_assistant(m, at, model_name))
            calls = {c["id"] for c in out[-1].get("tool_calls", [])}
        else:
            out += _user(m, at, calls, model_name)
            calls = set()
    if messages[-1].role == "assistant":
        # Prefill (continuing the reply from the assistant's text) needs the template to
        # leave its last turn open; Anthropic answers the same for its models without it.
        raise APIError(
            400,
            "this model does not support assistant message prefill: the conversation "
            "must end with a user (or system) message",
            param=f"messages.{len(messages) - 1}",
        )
    return out


def folded(messages: list[dict]) -> list[dict]:
    """The messages with each system message after the first turn folded into the user
    turn beside it (before it, else after it, else one of its own): for templates that
    take a system message at the start only. The same every request, so the prefix a
    conversation's cache holds stays the same."""
    out: list[dict] = []
    waiting: list[str] = []  # system text for the next user turn
    for k, m in enumerate(messages):
        if m["role"] != "system" or k == 0:
            if m["role"] == "user" and waiting:
                m = {**m, "content": JOIN.join([*waiting, m["content"]])}
                waiting = []
            out.append(m)
        elif out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": JOIN.join([out[-1]["content"], m["content"]])}
        else:
            waiting.append(m["content"])
    if waiting:
        out.append({"role": "user", "content": JOIN.join(waiting)})
    return out


def _assistant(m: InputMessage, at: int, model_name: str) -> dict:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(m.blocks()):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(template_call(block.id, block.name, block.input))
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by Anthropic: nothing to give back
        elif isinstance(block, DocumentBlock | ImageBlock):
            texts.append(_attachment(block, f"messages.{at}.content.{j}", model_name))
        else:
            raise APIError(
                400,
                f"an assistant turn cannot hold a {block.type!r} block",
                param=f"messages.{at}.content.{j}",
            )
    entry: dict[str, Any] = {"role": "assistant", "content": JOIN.join(texts)}
    if calls:
        entry["tool_calls"] = calls
    if reasoning:
        entry["reasoning_content"] = JOIN.join(reasoning)
    return entry


def _user(m: InputMessage, at: int, calls: set[str], model_name: str) -> list[dict]:
    """A user turn: its tool results as `tool` messages and its text as user messages, in
    the order they come."""
    out: list[dict] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": JOIN.join(texts)})
            texts.clear()

    for j, block in enumerate(m.blocks()):
        where = f"messages.{at}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise APIError(
                    400,
                    f"{where}: unexpected tool_use_id {block.tool_use_id!r} in a tool_result "
                    "block: each tool_result must answer a tool_use block of the assistant "
                    "turn just before it",
                    param=f"{where}.tool_use_id",
                )
            flush()
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _result_text(block, where, model_name),
                }
            )
        elif isinstance(block, DocumentBlock | ImageBlock):
            texts.append(_attachment(block, where, model_name))
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            continue  # reasoning belongs to assistant turns; a user's is dropped
        else:
            raise APIError(400, f"a user turn cannot hold a {block.type!r} block", param=where)
    flush()
    return out


def _result_text(block: ToolResultBlock, where: str, model_name: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for k, part in enumerate(block.content):
            if isinstance(part, TextBlock):
                parts.append(part.text)
            else:
                parts.append(_attachment(part, f"{where}.content.{k}", model_name))
        text = JOIN.join(parts)
    return TOOL_ERROR + text if block.is_error else text


def _attachment(block: ImageBlock | DocumentBlock, where: str, model_name: str) -> str:
    """A document's text; a 400 naming the block for what only a multimodal model reads."""
    if isinstance(block, DocumentBlock) and (text := block.text()) is not None:
        return text
    what = "an image" if isinstance(block, ImageBlock) else "a document that is not plain text"
    raise APIError(
        400,
        f"{where} is {what}, and {model_name} is a text-only model: send text",
        param=where,
    )


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else JOIN.join(b.text for b in content)
