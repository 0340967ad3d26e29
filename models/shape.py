"""What the caches and the budget need to know of a loaded model: its KV shape.

`kv_shape(model)`: attention layers, KV heads, head dim, the K/V element width, the
trained context and each sliding-window layer's window. K/V are float32 on MLX's CPU
device (the weights are cast there: models/loading.py), the model's half type on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

# The context assumed for a model whose config states none (max_position_embeddings);
# the server warns at start-up and `--context` sets the real one.
ASSUMED_CONTEXT = 4096


# What one cache slot (one entry of make_prompt_cache) holds; cache/factory.py builds by it
# and cache/budget.py prices by it.
GLOBAL = "global"  # per-token K/V, attended over the whole sequence: the policy's cache
SLIDING = "sliding"  # per-token K/V inside a window (mlx-lm's RotatingKVCache, keep 0)
LATENT = "latent"  # MLA: a compressed latent and a RoPE part per token (K and V widths differ)
STATE = "state"  # recurrent / linear-attention / SSM state: fixed bytes, whatever the length
OTHER = "other"  # another model-provided cache (kept as mlx-lm made it)
PER_TOKEN = (GLOBAL, SLIDING, LATENT)


@dataclass(frozen=True)
class CacheSlot:
    """One cache of the model's make_prompt_cache, as measured by one token through it."""

    kind: str
    kv_heads: int = 0
    key_width: int = 0  # per head and token (MLA: the latent)
    value_width: int = 0  # (MLA: the RoPE part of the key)
    window: int | None = None  # SLIDING: its window
    fixed_bytes: int = 0  # STATE / OTHER: what it holds after one token
    layer: int | None = None  # the index in model.layers of the layer that owns it
    sinks: bool = False  # its attention adds learned per-head sink logits (gpt-oss)

    @property
    def head_dim(self) -> int:
        """One width standing for both: K and V of one token cost 2 x head_dim elements."""
        return (self.key_width + self.value_width) // 2


@dataclass(frozen=True)
class ModelShape:
    layers: int  # attention layers holding a KV cache
    kv_heads: int
    head_dim: int
    element_bytes: int  # K/V dtype: 4 for float32 (CPU), 2 for float16/bfloat16
    context: int  # the model's trained context length
    # Sliding-window sizes of the layers that have one (Gemma 3: 15 of 18 at 512);
    # the other layers attend globally.
    windows: tuple[int, ...] = ()
    context_stated: bool = True  # False: the model states none, ASSUMED_CONTEXT is used
    # Layers that attend over another layer's K/V as its cache returns them (Gemma 4's
    # KV-shared layers), outside the router: they read dense K/V only.
    kv_shared_layers: int = 0
    # Every cache slot as measured (layer_plan); empty for a shape written by hand, which
    # prices `layers` uniform layers. With slots, each per-token layer is priced at its own
    # heads and widths and each state layer at its fixed bytes (cache/budget.py).
    slots: tuple[CacheSlot, ...] = ()

    @classmethod
    def of(cls, model: nn.Module, element_bytes: int, windows: tuple[int, ...] = ()) -> ModelShape:
        """`windows`: what layer_windows reports for this model."""
        args = text_args(model)
        heads = args.num_attention_heads
        kv_heads = getattr(args, "num_key_value_heads", None) or heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
        context = getattr(args, "max_position_embeddings", None)
        return cls(
            len(model.layers), kv_heads, head_dim, element_bytes, context or ASSUMED_CONTEXT,
            windows, context_stated=context is not None,
        )  # fmt: skip

    @property
    def global_layers(self) -> int:
        return self.layers - len(self.windows)

    @property
    def dense_token_bytes(self) -> int:
        """K and V of one token in one KV head, dense."""
        return 2 * self.head_dim * self.element_bytes

    def for_slot(self, slot: CacheSlot) -> ModelShape:
        """This shape as one per-token slot sees it (its heads and widths)."""
        return replace(self, layers=1, kv_heads=slot.kv_heads, head_dim=slot.head_dim, slots=())

    @property
    def split_widths(self) -> tuple[CacheSlot, ...]:
        """The per-token slots whose K and V differ in width (MLA's latent and RoPE part)."""
        return tuple(s for s in self.slots if s.kind in PER_TOKEN and s.key_width != s.value_width)


def on_cpu() -> bool:
    """Whether MLX computes on its CPU device (float32 is its fast path there)."""
    return mx.default_device() == mx.cpu


def element_bytes(model: nn.Module) -> int:
    """Bytes of one K/V element: the dtype of the model's floating-point weights (float32
    on the CPU once cast, the model's half type on a GPU)."""
    from mlx.utils import tree_flatten

    for _, w in tree_flatten(model.parameters()):
        if mx.issubdtype(w.dtype, mx.floating):
            return w.dtype.size
    return 4 if on_cpu() else 2


def _is_sliding_layer(layer: nn.Module) -> bool:
    """mlx-lm marks sliding-window layers with one of these flags."""
    attn = getattr(layer, "self_attn", None)
    return any(
        bool(getattr(obj, flag, False))
        for obj in (layer, attn)
        if obj is not None
        for flag in ("use_sliding", "is_sliding")
    )


def text_args(model: nn.Module):
    """The model's text-model arguments: `args`, or what it wraps as `text_config` (Qwen3.5,
    Gemma 4, Mistral 3 wrap their language model's arguments so)."""
    args = getattr(model, "args", None)
    inner = getattr(getattr(model, "language_model", None), "args", None)
    text = getattr(args, "text_config", None)
    if inner is not None and getattr(inner, "num_attention_heads", None) is not None:
        return inner
    if isinstance(text, dict):
        return SimpleNamespace(**text)
    return text if text is not None else args


def cache_owners(model: nn.Module, caches: list) -> list[nn.Module | None]:
    """The layer of model.layers that owns each cache of make_prompt_cache, or None.

    One cache per layer where the counts agree. mlx-lm gives fewer where some layers hold
    none: MLP-only layers (Nemotron-H's `-` blocks) and layers that reuse an earlier
    layer's K/V (Gemma 4's last `num_kv_shared_layers`); those are skipped in order.
    """
    layers = list(getattr(model, "layers", None) or [])
    if len(layers) == len(caches):
        return layers
    holding = [layer for layer in layers if not _holds_no_cache(layer)]
    if len(holding) == len(caches):
        return holding
    shared = text_args(model)
    n_shared = getattr(shared, "num_kv_shared_layers", 0) or 0
    if n_shared and len(layers) - n_shared == len(caches):
        return layers[: len(caches)]
    return [None] * len(caches)


def _holds_no_cache(layer: nn.Module) -> bool:
    """An MLP-only layer (Nemotron-H's `-`), or one reading another layer's K/V (Gemma 4)."""
    return getattr(layer, "block_type", None) == "-" or _shares_kv(layer)


def _shares_kv(layer: nn.Module) -> bool:
    return getattr(getattr(layer, "self_attn", None), "has_kv", True) is False


def _attention(layer: nn.Module | None) -> nn.Module | None:
    for name in ("self_attn", "attention", "attn", "mixer"):
        module = getattr(layer, name, None)
        if module is not None:
            return module
    return None


def layer_plan(model: nn.Module) -> list[CacheSlot]:
    """Each cache slot of the model: its kind, heads, widths, window or fixed bytes.

    Measured, not read from configs: one token through the model's own make_prompt_cache
    shows what each cache holds (K/V shapes, a window, a state's bytes), so every
    family's layout (sliding, shared, latent, state-space, MLP-only) is seen as mlx-lm
    builds it. Remembered on the model.
    """
    known = getattr(model, "_h2o_layer_plan", None)
    if known is not None:
        return list(known)
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    owners = cache_owners(model, caches)
    layers = list(getattr(model, "layers", None) or [])
    model_window = getattr(text_args(model), "sliding_window", None)
    plan = []
    for cache, owner in zip(caches, owners, strict=True):
        index = next((i for i, layer in enumerate(layers) if layer is owner), None)
        plan.append(_slot(cache, owner, index, model_window))
    object.__setattr__(model, "_h2o_layer_plan", tuple(plan))
    return plan


def _slot(cache, owner: nn.Module | None, index: int | None, model_window) -> CacheSlot:
    attn = _attention(owner)
    sinks = getattr(attn, "sinks", None) is not None
    if type(cache) in (KVCache, RotatingKVCache) and cache.keys is not None:
        _, heads, _, k_width = cache.keys.shape
        v_width = cache.values.shape[-1]
        if type(cache) is RotatingKVCache:
            kind, window = (SLIDING, cache.max_size) if cache.keep == 0 else (OTHER, None)
        elif owner is not None and model_window and _is_sliding_layer(owner):
            kind, window = SLIDING, model_window
        else:
            latent = getattr(attn, "kv_lora_rank", None) is not None
            kind, window = (LATENT if latent else GLOBAL), None
        fixed = cache.nbytes if kind == OTHER else 0
        return CacheSlot(kind, heads, k_width, v_width, window, fixed, index, sinks)
    arrays = [a for a in getattr(cache, "state", None) or [] if isinstance(a, mx.array)]
    kind = STATE if isinstance(cache, ArraysCache) else OTHER
    return CacheSlot(kind, fixed_bytes=sum(a.nbytes for a in arrays), layer=index, sinks=sinks)


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each cache slot's sliding attention window; None for global attention (and other
    state). One entry per cache of make_prompt_cache (fewer than model.layers where some
    layers hold none)."""
    return [slot.window if slot.kind == SLIDING else None for slot in layer_plan(model)]


def kv_shape(model: nn.Module) -> ModelShape:
    """What the budget math needs of a loaded model: the first per-token layer's heads and
    widths as the uniform summary, and every slot for per-layer prices."""
    plan = layer_plan(model)
    args = text_args(model)
    context = getattr(args, "max_position_embeddings", None) or _context_of(args)
    per_token = [s for s in plan if s.kind in PER_TOKEN]
    first = next((s for s in per_token if s.kind != SLIDING), per_token[0] if per_token else None)
    return ModelShape(
        layers=len(per_token),
        kv_heads=first.kv_heads if first else 0,
        head_dim=first.head_dim if first else 0,
        element_bytes=element_bytes(model),
        context=context or ASSUMED_CONTEXT,
        windows=tuple(s.window for s in per_token if s.kind == SLIDING),
        context_stated=context is not None,
        kv_shared_layers=sum(_shares_kv(layer) for layer in getattr(model, "layers", None) or []),
        slots=tuple(plan),
    )


def _context_of(args) -> int | None:
    """A context stated under another name than max_position_embeddings (gpt-oss states
    its original one inside rope_scaling, YaRN-extended to max_position_embeddings)."""
    for name in ("max_sequence_length", "seq_length", "n_ctx", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    scaling = getattr(args, "rope_scaling", None)
    scaling = scaling if isinstance(scaling, dict) else {}
    original, factor = scaling.get("original_max_position_embeddings"), scaling.get("factor")
    if original and factor:
        return int(original * factor)
    return None
