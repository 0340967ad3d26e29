"""GGUF architectures -> mlx-lm models: config, tensor names, weight fix-ups.

One `Architecture` per supported `general.architecture`: the mlx-lm model
module it becomes, the mlx-lm config derived from the file (fields a GGUF does
not store are defaulted as llama.cpp does for that architecture), GGUF tensor
names -> mlx-lm parameter names, and what llama.cpp's converter changed that
must be undone:
- llama: q/k projection rows are permuted for GGUF's RoPE layout.
- gemma3: RMSNorm weights are stored with Gemma's +1 folded in; mlx-lm's
  gemma3_text adds 1 itself, so 1 is subtracted.
Tensors are dequantized to float32 and the model computes in the dtype its loader
asks for: float32 on MLX's CPU, the architecture's half type on a GPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from models.gguf_file import GGUFError, GGUFFile, load_tensors, read_gguf
from models.gguf_tokenizer import gguf_tokenizer

_COMMON_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Architecture:
    mlx_module: str  # mlx_lm.models.<name>
    config: Callable[[GGUFFile], dict[str, Any]]
    layer_names: dict[str, str]  # GGUF blk.N.<base> -> mlx-lm layers.N.<name>
    fix_weight: Callable[[str, mx.array, dict[str, Any]], mx.array]
    # The half type a GPU computes it in: Gemma's activations overflow float16's range
    # (its checkpoints are bfloat16); llama.cpp computes llama in float16.
    half: mx.Dtype = mx.float16


def _get(file: GGUFFile, key: str, default: Any = None) -> Any:
    value = file.metadata.get(f"{file.architecture}.{key}", default)
    if value is None:
        raise GGUFError(f"{file.path.name}: metadata {file.architecture}.{key} is missing")
    return value


def _check_rope_scaling(file: GGUFFile) -> dict[str, Any] | None:
    kind = file.metadata.get(f"{file.architecture}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(_get(file, "rope.scaling.factor"))}
    raise GGUFError(f"{file.path.name}: RoPE scaling {kind!r} is not supported (linear is)")


def _common_config(file: GGUFFile) -> dict[str, Any]:
    heads = int(_get(file, "attention.head_count"))
    hidden = int(_get(file, "embedding_length"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(_get(file, "block_count")),
        "intermediate_size": int(_get(file, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_get(file, "attention.head_count_kv", heads)),
        "rms_norm_eps": float(_get(file, "attention.layer_norm_rms_epsilon")),
        "vocab_size": len(file.metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(_get(file, "context_length")),
    }


def _llama_config(file: GGUFFile) -> dict[str, Any]:
    cfg = _common_config(file)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return {
        **cfg,
        "model_type": "llama",
        "head_dim": int(_get(file, "rope.dimension_count", head_dim)),
        "rope_theta": float(_get(file, "rope.freq_base", 10000.0)),
        "rope_scaling": _check_rope_scaling(file),
    }


def _gemma3_config(file: GGUFFile) -> dict[str, Any]:
    cfg = _common_config(file)
    head_dim = int(_get(file, "attention.key_length", 256))
    # llama.cpp: attention scale 1/sqrt(head_dim), except Gemma 3 27B (62 layers)
    # which uses 1/sqrt(hidden / heads); the window pattern (5 local : 1 global)
    # and the local RoPE base are not stored in the file.
    if cfg["num_hidden_layers"] == 62:
        query_scale = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        query_scale = head_dim
    return {
        **cfg,
        "model_type": "gemma3_text",
        "head_dim": head_dim,
        "rope_theta": float(_get(file, "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": query_scale,
        "sliding_window": int(_get(file, "attention.sliding_window")),
        "sliding_window_pattern": 6,
        "rope_scaling": _check_rope_scaling(file),
    }


def unpermute_rope_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo GGUF's per-head row interleave of llama q/k projections (rows only)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _llama_fix(name: str, w: mx.array, cfg: dict[str, Any]) -> mx.array:
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute_rope_rows(w, cfg["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute_rope_rows(w, cfg["num_key_value_heads"])
    return w


def _gemma_fix(name: str, w: mx.array, cfg: dict[str, Any]) -> mx.array:
    return w - 1.0 if name.endswith("norm.weight") else w


ARCHITECTURES = {
    "llama": Architecture(
        "llama", _llama_config, {**_COMMON_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"},
        _llama_fix,
    ),
    "gemma3": Architecture(
        "gemma3_text",
        _gemma3_config,
        {
            **_COMMON_LAYER_NAMES,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        _gemma_fix,
        mx.bfloat16,
    ),
}  # fmt: skip


def architecture_of(file: GGUFFile) -> Architecture:
    arch = ARCHITECTURES.get(file.architecture)
    if arch is None:
        raise GGUFError(
            f"{file.path.name}: GGUF architecture {file.architecture!r} is not supported "
            f"({', '.join(sorted(ARCHITECTURES))})"
        )
    return arch


def mlx_name(name: str, arch: Architecture) -> str:
    """GGUF tensor name -> mlx-lm parameter name; unknown names are an error."""
    parts = name.split(".")
    base = parts[2] if parts[0] == "blk" and len(parts) > 3 else parts[0]
    if parts[0] == "blk" and base in arch.layer_names:
        return f"model.layers.{parts[1]}.{arch.layer_names[base]}.{'.'.join(parts[3:])}"
    if parts[0] in _TOP_NAMES and len(parts) > 1:
        return f"{_TOP_NAMES[parts[0]]}.{'.'.join(parts[1:])}"
    raise GGUFError(f"GGUF tensor {name!r} has no place in mlx-lm's {arch.mlx_module} model")


def half_dtype(file: GGUFFile) -> mx.Dtype:
    """The dtype a GPU computes this file's model in: bfloat16 where the file stores its
    tensors so, else its architecture's half type."""
    if any(t.type_name == "BF16" for t in file.tensors):
        return mx.bfloat16
    return architecture_of(file).half


def load_gguf(
    path: str | Path, dtype: mx.Dtype | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """A GGUF of a supported architecture as an mlx-lm model and its tokenizer.

    `dtype`: of the floating-point weights (float32 on MLX's CPU); None: `half_dtype`."""
    file = read_gguf(path)
    arch = architecture_of(file)
    cfg = arch.config(file)  # before the (slow) tensor read, so bad files fail fast
    tokenizer = gguf_tokenizer(file.metadata)
    dtype = dtype or half_dtype(file)
    weights = {}
    for name, w in load_tensors(file).items():
        mlx = mlx_name(name, arch)
        weights[mlx] = arch.fix_weight(mlx, w, cfg).astype(dtype)
    cfg["tie_word_embeddings"] = "lm_head.weight" not in weights
    module = importlib.import_module(f"mlx_lm.models.{arch.mlx_module}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, tokenizer
