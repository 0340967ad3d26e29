"""Server settings as a pydantic model; `serve` flags (and H2O_* env vars) map onto it.

Names and choices come from the cache vocabulary (config/cache_spec.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from config.cache_spec import (
    AUTO,
    DEFAULT_GROUP_SIZE,
    DEFAULT_KVARN,
    DEFAULT_PRESET,
    DEFAULT_SCORE,
    QUANT_GROUP_SIZES,
    KVarNPresetName,
    PresetName,
    ScoreRuleName,
    ServePolicyName,
)

DRAFT_MAX = 12  # speculative decoding's default draft length (server/engine/speculation.py)


class ServerSettings(BaseSettings):
    """`h2o-server serve`: every flag is also an environment variable H2O_<NAME>.

    Flags win over the environment, which wins over these defaults.
    """

    model_config = SettingsConfigDict(env_prefix="H2O_", extra="ignore")

    model: str = Field(
        "default",
        description="'default', 'gemma3-270m', a .gguf, a model folder or a repo id, loaded at "
        "start; NAME=PATH serves it as NAME. Given again, each further one is served on demand",
    )
    models: list[str] = Field(
        default_factory=list,
        description="more models served on demand, each PATH or NAME=PATH (a repeated --model "
        "adds here)",
    )
    models_file: str | None = Field(
        None,
        description="a TOML file of models served on demand: a [name] table each, with "
        "source, and optional aliases, ttl and pin (docs/models.md)",
    )
    models_dir: str | None = Field(
        None,
        description="a folder of models served on demand: each MLX model folder (named by "
        "its folder) and .gguf file (by its stem); the Hugging Face cache's MLX models too",
    )
    max_loaded_models: int = Field(
        3,
        ge=1,
        description="models held in memory at once; loading one more unloads the least "
        "recently used idle one (its sessions spilled to --spill-dir)",
    )
    model_ttl: float = Field(
        0,
        ge=0,
        description="seconds an idle model stays loaded (0: until another needs its place); "
        "a request's keep_alive overrides it for its model",
    )
    memory_budget: str = Field(
        "auto",
        description="memory for every loaded model's weights and KV share together: loading "
        "one past it unloads idle ones first; 16GiB, 0 (none), or auto (3/4 of memory)",
    )
    pin: list[str] = Field(
        default_factory=list, description="models never unloaded for another or by idle time"
    )
    served_model_name: list[str] = Field(
        default_factory=list,
        description="names the model is served under (several: clients that insist on a "
        "model name reach it by any; the first is the id replies and /v1/models give)",
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
    draft_max: int = Field(
        DRAFT_MAX,
        ge=0,
        le=64,
        description="speculative decoding: most tokens a draft (the conversation's own "
        "n-grams, a grammar's forced tokens) feeds beside the decoding token; 0: off",
    )
    draft_model: str | None = Field(
        None,
        description="speculative decoding: a small model with the served model's tokenizer "
        "that drafts where the conversation repeats nothing (a path, a repo id, or "
        "'default'); used by each served model whose tokenizer it shares",
    )
    preset: PresetName = DEFAULT_PRESET
    score: ScoreRuleName = DEFAULT_SCORE
    kv_rotate: bool | None = Field(
        None,
        description="h2o-q8, h2o-q4, h2o-mixed: Hadamard-rotate K/V before packing (default: "
        "on for h2o-q4's 4-bit keys: KL to dense h2o 0.006 instead of 0.011; without the "
        "dense tail +3.3% perplexity instead of +6.4%)",
    )
    kv_group_size: int = Field(
        DEFAULT_GROUP_SIZE,
        description="packed policies' quantization group: one scale and bias per this many "
        "values (h2o-q4 in groups of 32: -0.1% vs dense h2o where 64 is +0.5%, 1.4 KB more "
        "per token)",
    )
    kv_dense_recent: int | None = Field(
        None,
        ge=0,
        description="h2o-q8, h2o-q4, h2o-mixed: newest tokens also kept dense, beside their "
        "packed copies (default: 16 for h2o-q4's 4-bit keys, none for 8-bit keys: rotated "
        "h2o-q4 goes from +2-3% perplexity vs dense h2o to +0.5% or less)",
    )
    kvarn: KVarNPresetName = Field(
        DEFAULT_KVARN,
        description="kvarn, h2o-kvarn: key and value bits. k4v2 (mlx-kvarn's); k4v4 costs "
        "6% more bytes at max_kv 256 and +1.2% perplexity vs dense h2o where k4v2 is +1.9%",
    )
    layer_budgets: str = Field(
        "auto",
        description="per-layer max_kv: auto (the shipped profile of these weights, else "
        "uniform), uniform, or a profile file from `h2o-server calibrate`",
    )
    max_queue: int = Field(32, ge=1, description="requests waiting beyond this get 429")
    spill_dir: str | None = Field(
        None,
        description="folder for sessions spilled from memory and at shutdown, indexed again "
        "on start (unset: drop them); replicas may share one",
    )
    spill_idle_seconds: float | None = Field(
        None,
        ge=0,
        description="spill a session to --spill-dir once idle this long (replicas sharing the "
        "folder can then restore it; unset: only when memory is needed)",
    )
    claim_wait: float = Field(
        10.0,
        ge=0,
        description="seconds a turn waits for a session another replica holds (it hands it "
        "over when idle) before it is served with a cache rebuilt from the prompt",
    )
    spill_budget: str = Field(
        "auto", description="disk for every file in --spill-dir (auto: 2x --kv-budget)"
    )
    context: int | None = Field(
        None,
        ge=64,
        description="the context window in tokens (default: the model's own): the longest "
        "conversation under policy full; under h2o, h2o-q8 and h2o-q4 a conversation outgrows "
        "it, its RoPE positions re-indexed within the cache before they reach it",
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="most prompt tokens one request may bring that its conversation's cache "
        "does not hold yet (default: the context); above the context only for policies that "
        "evict",
    )
    shutdown_timeout: float = Field(
        5.0,
        ge=0,
        description="seconds in-flight requests may run after SIGTERM before they are "
        "cancelled (a second signal exits at once)",
    )
    kernel: str = Field("auto", description="attention backend: auto, reference, metal, cuda")
    api_key: str | None = Field(
        None,
        description="require 'Authorization: Bearer <key>' on every route but /health; "
        "several keys: k1,k2",
    )
    session_scope: Literal["shared", "caller"] = Field(
        "shared",
        description="caller: a session belongs to the API key and `user` that made it; "
        "others cannot list, reuse or delete it",
    )
    prefix_share: float = Field(
        0.125,
        ge=0,
        lt=1,
        description="share of --kv-budget kept for system prompts that new conversations "
        "fork instead of prefilling again (the rest is the sessions'; 0: no prefix store)",
    )
    prefix_min_tokens: int = Field(
        256,
        ge=1,
        description="shortest system prompt, in tokens, kept for other conversations to fork",
    )
    share_prefixes: bool = Field(
        False,
        description="under --session-scope caller, let every caller fork every stored system "
        "prompt (default: only the caller that sent it; a system prompt can be a secret)",
    )
    default_temperature: float | None = Field(
        None,
        ge=0,
        le=2,
        description="sampling temperature of a request that sends none, in every API (unset: "
        "1.0, OpenAI's and Anthropic's default). Agents send none (Codex CLI, Claude Code), "
        "and a small model at 1.0 rambles: 0.2 or 0 keeps its replies short",
    )
    responses_max_stored: int = Field(
        10000,
        ge=1,
        description="/v1/responses: most stored responses kept (store: true); past it the "
        "oldest goes out (a chain continued from a later one keeps its history)",
    )
    responses_max_bytes: str = Field(
        "256MiB",
        description="/v1/responses: most bytes of stored responses (their items and "
        "Response objects, as JSON), oldest out; with --spill-dir they are on disk too "
        "(in <spill-dir>/responses, counted in --spill-budget)",
    )
    responses_max_age_seconds: float = Field(
        30 * 24 * 3600.0,
        gt=0,
        description="/v1/responses: a stored response expires this long after it was "
        "made (default 30 days, as OpenAI keeps them); its id then gets a 404",
    )
    allowed_origins: list[str] = Field(default_factory=list, description="CORS origins")
    ui: bool | None = Field(
        None, description="serve the chat page at / (default: on when --host is loopback)"
    )
    log_level: str = "info"

    @field_validator("kv_group_size")
    @classmethod
    def _mx_quantize_group(cls, value: int) -> int:
        if value not in QUANT_GROUP_SIZES:
            raise ValueError(f"must be one of {QUANT_GROUP_SIZES} (mx.quantize's group sizes)")
        return value
