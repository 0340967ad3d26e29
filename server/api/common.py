"""What every API's protocol module shares: the request base, the `kv_cache` extension,
text checks, ids, and OpenAI's error body (server/api/errors.py picks each API's shape).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from config.cache_spec import KVarNPresetName, PolicyName, PresetName, ScoreRuleName
from config.durations import keep_alive_seconds

SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
# OpenAI documents seed as a signed 64-bit integer; unsigned 64-bit seeds are taken too.
# Sampling reduces a seed modulo 2**64 (so -1 and 2**64 - 1 draw the same tokens).
SEED_RANGE = (-(2**63), 2**64 - 1)
# The reply header naming the tools a request offered that the server cannot run
# (web search, MCP...): left out of the prompt, never a failed request.
TOOLS_NOT_OFFERED = "X-Tools-Not-Offered"
# This server's extension in every API (Ollama's field): how long the request's model stays
# loaded once idle (docs/models.md).
KeepAlive = Annotated[float | None, BeforeValidator(keep_alive_seconds)]


def json_text(text: str) -> str:
    """`text` (a call's arguments: JSON inside a string) if what it decodes to is text, else
    a ValueError naming where a lone surrogate sits: its own escapes decode only when a
    template renders it. Text that is not JSON passes as the text it is."""
    try:
        decoded = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    if (where := lone_surrogate(decoded)) is not None:
        raise ValueError(f"its JSON at {where} {LONE_SURROGATE}")
    return text


def object_schema(schema: dict[str, Any] | None, field: str) -> dict[str, Any] | None:
    """`schema` if it is a JSON schema of an object (or leaves the type open), else a
    ValueError naming `field`. A call's arguments are a JSON object (every API's rule; a
    stream finds their end by their braces): a tool typed otherwise can never be called."""
    declared = (schema or {}).get("type", "object")
    if declared != "object" and not (isinstance(declared, list) and "object" in declared):
        raise ValueError(f'{field} must be a JSON schema of type "object", got {declared!r}')
    return schema


def temperature_or_default(sent: float | None, default: float | None) -> float:
    """A request's temperature: the one it sent, else --default-temperature, else 1.0 (the
    default of OpenAI's and Anthropic's APIs). Agents send none (Codex CLI, Claude Code)."""
    if sent is not None:
        return sent
    return 1.0 if default is None else default


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextRequest(Request):
    """A request body whose every string must be text: a lone surrogate is a 400 naming
    where it is (`lone_surrogate`)."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        if (where := lone_surrogate(data)) is not None:
            raise ValueError(f"{where} {LONE_SURROGATE}")
        return data


class CacheOptions(Request):
    """The `kv_cache` extension object: this conversation's cache, within the server's budget."""

    policy: PolicyName | None = None
    max_kv: int | None = Field(None, ge=16)
    preset: PresetName | None = None
    score: ScoreRuleName | None = None
    kvarn: KVarNPresetName | None = None


def lone_surrogate(value: Any) -> str | None:
    """Where in decoded JSON `value` a string (or key) holds a lone UTF-16 surrogate, or
    None. JSON's "\\ud800" escape decodes to one, which is no text: the tokenizer and
    UTF-8 both refuse it, so it is the client's error, not the template's. A loop, not
    recursion: a body as deep as the JSON parser takes must not overflow here."""
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            items = list(v.items())
        elif isinstance(v, list):
            items = list(enumerate(v))
        else:
            if isinstance(v, str) and not _utf8(v):
                return _where(path)
            continue
        for key, _ in items:
            if isinstance(key, str) and not _utf8(key):
                return _where((*path, key))
        stack += [((*path, key), item) for key, item in reversed(items)]
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _where(path: tuple) -> str:
    """A path as a field name, its own surrogates escaped (an error message must encode)."""
    return ".".join(str(p).encode("utf-8", "backslashreplace").decode() for p in path) or "body"


LONE_SURROGATE = "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): not text"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None):
    detail = ErrorDetail(message=message, type=type_, param=param, code=code)
    return ErrorResponse(error=detail).model_dump()
