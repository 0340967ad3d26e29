"""Server settings as a pydantic model; `serve` flags (and H2O_* env vars) map onto it.

Names and choices come from the cache vocabulary (config/cache_spec.py).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from config.cache_spec import (
    AUTO,
    DEFAULT_PRESET,
    DEFAULT_SCORE,
    PresetName,
    ScoreRuleName,
    ServePolicyName,
)


class ServerSettings(BaseSettings):
    """`h2o-server serve`: every flag is also an environment variable H2O_<NAME>.

    Flags win over the environment, which wins over these defaults.
    """

    model_config = SettingsConfigDict(env_prefix="H2O_", extra="ignore")

    model: str = Field(
        "default", description="'default', 'gemma3-270m', a .gguf, a model folder or a repo id"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    policy: ServePolicyName = Field(AUTO, description="KV cache policy of each conversation")
    kv_budget: str = Field("auto", description="memory for all KV caches: 1GiB, 512MB, or auto")
    max_sessions: int = Field(8, ge=1, description="conversations kept in memory at once")
    prefill_step: int = Field(512, ge=16, description="prompt tokens per forward pass")
    prefill_budget: int = Field(
        512,
        ge=16,
        description="prompt tokens prefilled per round while others decode (whole chunks, "
        "at least one)",
    )
    preset: PresetName = DEFAULT_PRESET
    score: ScoreRuleName = DEFAULT_SCORE
    max_queue: int = Field(32, ge=1, description="requests waiting beyond this get 429")
    spill_dir: str | None = Field(
        None, description="folder for sessions spilled from memory (unset: drop them)"
    )
    kernel: str = Field("auto", description="attention backend: auto, reference, metal, cuda")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>'")
    allowed_origins: list[str] = Field(default_factory=list, description="CORS origins")
    log_level: str = "info"
