"""OpenAI request and response shapes (the subset this server speaks), as pydantic models.

Requests ignore fields they do not know (SDKs send more than we use); what
they do carry is validated, so bad values become 400s in OpenAI's error shape.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from config.settings import Preset, ScoreRule

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SESSION_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheOptions(Request):
    """The `kv_cache` extension object: this conversation's cache, within the server's budget."""

    policy: Literal["full", "rotating", "h2o", "h2o-q8", "h2o-q4", "h2o-mixed"] | None = None
    max_kv: int | None = Field(None, ge=16)
    preset: Preset | None = None
    score: ScoreRule | None = None


class StreamOptions(Request):
    include_usage: bool = False


class SamplingRequest(Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    prompt_cache_key: str | None = Field(None, pattern=SESSION_ID_PATTERN)
    kv_cache: CacheOptions | None = None

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

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        for m in self.messages:
            m.text()  # rejects non-text parts early
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def n_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    def token_limit(self) -> int | None:
        return self.max_tokens or 16  # OpenAI's default for completions

    def n_logprobs(self) -> int | None:
        return self.logprobs


# --------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
