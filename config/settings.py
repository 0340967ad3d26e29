"""Settings as pydantic models; command-line flags (and env vars) map onto them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

Policy = Literal["full", "rotating", "h2o"]
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

    @model_validator(mode="after")
    def _segments_fit(self) -> CacheSettings:
        from cache.presets import split_budget

        try:
            split_budget(self.max_kv, self.preset, self.sink, self.heavy, self.recent)
        except ValueError as e:
            raise ValueError(f"--max-kv/--sink/--heavy/--recent do not fit: {e}") from None
        return self

    def make(self, model) -> list:
        from cache import make_cache

        return make_cache(model, **self.model_dump())
