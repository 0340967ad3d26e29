"""Tiny random-weight configs of the mlx-lm model families the server serves (issue 77).

Each builds from mlx-lm's own classes in milliseconds, float32, with every layer kind the
family has:
- llama, qwen3, ministral3, phi3: grouped-query attention, one KVCache a layer (llama with
  llama3 RoPE scaling, ministral3 with YaRN and its Llama-4 attention scale).
- smollm3: attention layers with RoPE and without it (NoPE every second layer).
- qwen3_moe, glm4_moe: mixture-of-experts MLPs (4 experts, top-2); glm4_moe with a dense
  first layer, a shared expert, qk-norm and partial RoPE.
- qwen3_next, qwen3_5, qwen3_5_moe: gated-delta linear attention (ArraysCache) alternating
  with gated full attention (KVCache); qwen3_5 and qwen3_5_moe wrap it in `text_config`.
- gemma3_text, olmo3: sliding-window layers (RotatingKVCache) and full layers (KVCache).
- gemma4_text: sliding layers (head dim 32) and full layers (head dim 64, proportional
  RoPE), per-layer inputs, and two KV-shared layers that attend over the cache of the last
  earlier layer of their type, so it has 2 caches for 4 layers.
- gpt_oss: learned attention sinks (mlx-lm starts them at zero) on a sliding and a full
  layer, MoE MLPs, YaRN RoPE.
- deepseek_v3: multi-head latent attention (MLA: the KVCache holds the 64-wide latent and
  the 32-wide RoPE key), a dense first layer, then MoE with a shared expert.
- kimi_linear: three Kimi delta attention layers (ArraysCache), then an MLA layer (KVCache);
  a dense first layer, then MoE.
- nemotron_h: pattern "M-*-": Mamba-2, MLP-only (no cache), attention, MLP-only layers,
  so it has 2 caches for 4 layers.
- granitemoehybrid: Mamba-2 layers and a NoPE attention layer, MoE with a shared expert.
- lfm2: short-convolution layers (ArraysCache) and an attention layer.
Sliding windows are 8 tokens, so a 12-token prompt already overflows them. Attention head
dims are 32 (gemma4_text's full layers 64), so a quantization group of 32 divides them; the
Mamba-2 heads of nemotron_h and granitemoehybrid are 16 wide.
"""

from __future__ import annotations

import importlib

import mlx.core as mx

VOCAB = 64
# The attention shape most families share: 4 query / 2 KV heads of 32, hidden 64.
_ATTENTION = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}

# DeepSeek's expert routing (4 routed + 1 shared, top-2 in one group), as GLM 4.5 too.
_DEEPSEEK_MOE = {
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}

# Qwen3.5's text model (Gated DeltaNet layers, then gated attention every 2nd layer), which
# both Qwen3.5 configs wrap as `text_config`.
_QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
    "tie_word_embeddings": True,
}

FAMILIES: dict[str, dict] = {
    "llama": {
        "model_type": "llama",
        **_ATTENTION,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        **_ATTENTION,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        **_ATTENTION,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        **_ATTENTION,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_5": {"model_type": "qwen3_5", "text_config": _QWEN3_5_TEXT},
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": {
            **_QWEN3_5_TEXT,
            "model_type": "qwen3_5_moe_text",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        **_ATTENTION,
        "num_hidden_layers": 2,
        "sliding_window_pattern": 2,
        "sliding_window": 8,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        **_ATTENTION,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16,
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "sliding_window_pattern": 2,
        "sliding_window": 8,
        "num_kv_shared_layers": 2,
        "global_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {
                "partial_rotary_factor": 1.0,
                "rope_theta": 10000.0,
                "rope_type": "default",
            },
        },
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": True,
        "tie_word_embeddings": True,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 1024,
        },
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        **_DEEPSEEK_MOE,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 1024,
        },
    },
    "kimi_linear": {
        "model_type": "kimi_linear",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
        },
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "mla_use_nope": True,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "rms_norm_eps": 1e-5,
        "model_max_length": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        **_ATTENTION,
        "hybrid_override_pattern": "M-*-",
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
    },
    "granitemoehybrid": {
        "model_type": "granitemoehybrid",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "attention_bias": False,
        "position_embedding_type": "nope",
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.03125,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.22,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_proj_bias": False,
        "mamba_conv_bias": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "lfm2": {
        "model_type": "lfm2",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
    },
    "glm4_moe": {
        "model_type": "glm4_moe",
        **_ATTENTION,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
        **_DEEPSEEK_MOE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    "ministral3": {
        "model_type": "ministral3",
        **_ATTENTION,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 1024,
            "llama_4_scaling_beta": 0.1,
        },
        "tie_word_embeddings": True,
    },
    "smollm3": {
        "model_type": "smollm3",
        **_ATTENTION,
        "num_hidden_layers": 2,
        "no_rope_layer_interval": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 2000000.0,
        "tie_word_embeddings": True,
    },
    "olmo3": {
        "model_type": "olmo3",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "sliding_window": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "phi3": {
        "model_type": "phi3",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}


def config_of(family: str, **overrides) -> dict:
    """`family`'s config with `overrides` (inside its `text_config` where it wraps one)."""
    config = dict(FAMILIES[family])
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], **overrides}
        return config
    return {**config, **overrides}


def build(family: str, **overrides):
    """A float32 random-weight model of `family` (seeded), parameters evaluated;
    `overrides`: config fields changed."""
    config = config_of(family, **overrides)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


# --- as a model folder the server loads (mlx_lm.load: config, weights, tokenizer) ----------

SPECIAL = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "[UNK]"]
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_folder(family: str, folder, template: str = TEMPLATE, special: list[str] | None = None):
    """`family`'s tiny model saved as an MLX folder with a byte-level tokenizer (ChatML
    specials, then one token per printable byte: any text, any JSON a grammar forces; the
    model's rows exactly these, so every id it samples is text) and a ChatML template
    (or `template`, with its `special` tokens first); returns the folder."""
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model
    from word_tokenizer import CHARS, save_word_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = special or SPECIAL
    vocab = special + CHARS
    save_model(folder, build(family, vocab_size=len(vocab)))
    save_config(config_of(family, vocab_size=len(vocab)), folder / "config.json")
    save_word_tokenizer(folder, vocab, special, "<|im_end|>", template)
    return folder
