"""Settings as pydantic models; command-line flags (and env vars) map onto them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Policy = Literal["full", "rotating", "h2o", "h2o-q8", "h2o-q4", "h2o-mixed"]
Preset = Literal["heavy", "balanced"]
ScoreRule = Literal["attn", "ema"]


class CacheSettings(BaseModel):
    """How each conversation's KV cache is built (see cache.make_cache)."""

    policy: Policy = "h2o"
    max_kv: int = Field(256, ge=2, description="cache size in tokens per layer")
    preset: Preset = "heavy"
    score: ScoreRule = Field(
        "attn", description="attn: summed softmax (original H2O); ema: EMA of |logit|"
    )
    sink: int | None = Field(None, ge=0, description="sink tokens (default 4)")
    heavy: int | None = Field(None, ge=0, description="heavy-hitter slots (default: preset)")
    recent: int | None = Field(None, ge=1, description="recent-window slots (default: preset)")
    evict_batch: int | None = Field(
        None, ge=1, description="tokens evicted at once (default: max_kv/16, at most heavy)"
    )

    @model_validator(mode="after")
    def _segments_fit(self) -> CacheSettings:
        from cache.presets import split_budget

        try:
            budget = split_budget(self.max_kv, self.preset, self.sink, self.heavy, self.recent)
        except ValueError as e:
            raise ValueError(f"--max-kv/--sink/--heavy/--recent do not fit: {e}") from None
        if self.evict_batch is not None and self.evict_batch > max(1, budget.heavy):
            raise ValueError(f"--evict-batch must not exceed the heavy budget ({budget.heavy})")
        return self

    def make(self, model) -> list:
        from cache import make_cache

        return make_cache(model, **self.model_dump())


ServePolicy = Literal["full", "rotating", "h2o", "h2o-q8", "h2o-q4", "h2o-mixed", "auto"]


class ServerSettings(BaseSettings):
    """`h2o-server serve`: every flag is also an environment variable H2O_<NAME>.

    Flags win over the environment, which wins over these defaults.
    """

    model_config = SettingsConfigDict(env_prefix="H2O_", extra="ignore")

    model: str = Field("default", description="'default', a .gguf, a model folder or a repo id")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    policy: ServePolicy = Field("auto", description="KV cache policy of each conversation")
    kv_budget: str = Field("auto", description="memory for all KV caches: 1GiB, 512MB, or auto")
    max_sessions: int = Field(8, ge=1, description="conversations kept in memory at once")
    prefill_step: int = Field(512, ge=16, description="prompt tokens per forward pass")
    preset: Preset = "heavy"
    score: ScoreRule = "attn"
    max_queue: int = Field(32, ge=1, description="requests waiting beyond this get 429")
    spill_dir: str | None = Field(
        None, description="folder for sessions spilled from memory (unset: drop them)"
    )
    kernel: str = Field("auto", description="attention backend: auto, reference, metal, cuda")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>'")
    allowed_origins: list[str] = Field(default_factory=list, description="CORS origins")
    log_level: str = "info"
