"""Chat completions and completions requests as the engine's Turn (server/api/turns.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.api.chat.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormat,
    SamplingRequest,
)
from server.api.common import temperature_or_default
from server.api.structured import Function, template_call
from server.api.turns import Turn

# The request fields a 400 names, where they differ from the engine's own words.
CHAT_PARAMS = {"parameters": "tools[{i}].function.parameters"}


def chat_turn(
    body: ChatCompletionRequest,
    key: str | None,
    owner: str,
    default_temperature: float | None = None,
) -> Turn:
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    fmt = body.response_format
    answer_param = "response_format.json_schema.schema" if fmt and fmt.json_schema else None
    return Turn(
        **_common(body, key, owner, default_temperature),
        messages=chat_messages(body),
        max_tokens=body.token_limit(),
        functions=[
            Function(t.function.name, t.function.description, t.function.parameters)
            for t in body.tools or []
        ],
        tool_choice=named or choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls,
        answer=answer_schema(fmt),
        thinking=body.thinking(),
        effort=body.reasoning_effort,
        template_kwargs=body.chat_template_kwargs or {},
        params={**CHAT_PARAMS, "answer": answer_param or "response_format"},
    )


def completion_turn(
    body: CompletionRequest, key: str | None, owner: str, default_temperature: float | None = None
) -> Turn:
    """A completion's Turn: no messages (each prompt is its own job's tokens)."""
    return Turn(
        **_common(body, key, owner, default_temperature),
        messages=[],
        max_tokens=body.token_limit(),
        prompt_field="prompt",
    )


def _common(
    body: SamplingRequest, key: str | None, owner: str, default_temperature: float | None
) -> dict[str, Any]:
    sent = body.temperature if "temperature" in body.model_fields_set else None
    sampling = replace(
        body.sampling_params(0), temperature=temperature_or_default(sent, default_temperature)
    )
    return {
        "model": body.model,
        "sampling": sampling,
        "session_key": key,
        "owner": owner,
        "kv_cache": body.kv_cache,
        "keep_alive": body.keep_alive,
        "n": body.n,
    }


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The request's messages as chat-template messages (developer as system)."""
    messages = []
    for m in body.messages:
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        if m.tool_calls:
            entry["tool_calls"] = [
                template_call(c.id, c.function.name, c.arguments()) for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        entry["content"] = m.text()
        messages.append(entry)
    return messages


def answer_schema(fmt: ResponseFormat | None) -> dict | None:
    """The JSON schema a response_format asks the reply's text to follow, or None."""
    if fmt is None or fmt.type == "text":
        return None
    return {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
