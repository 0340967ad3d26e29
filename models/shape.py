"""What the caches and the budget need to know of a loaded model: its KV shape.

`kv_shape(model)`: attention layers, KV heads, head dim, the K/V element width, the
trained context and each sliding-window layer's window. K/V are float32 on MLX's CPU
device (the weights are cast there: models/loading.py), the model's half type on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

# The context assumed for a model whose config states none (max_position_embeddings);
# the server warns at start-up and `--context` sets the real one.
ASSUMED_CONTEXT = 4096


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

    @classmethod
    def of(cls, model: nn.Module, element_bytes: int, windows: tuple[int, ...] = ()) -> ModelShape:
        """`windows`: what layer_windows reports for this model."""
        args = model.args
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


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding attention window; None for global attention (and other state).

    mlx-lm gives sliding-window layers a RotatingKVCache of the window's size (no
    kept tokens), or marks them with a flag next to `args.sliding_window`.
    """
    base = make_prompt_cache(model)
    layers = getattr(model, "layers", None) or [None] * len(base)
    model_window = getattr(getattr(model, "args", None), "sliding_window", None)
    windows = []
    for layer, provided in zip(layers, base, strict=True):
        if type(provided) is RotatingKVCache and provided.keep == 0:
            windows.append(provided.max_size)
        elif layer is not None and model_window and _is_sliding_layer(layer):
            windows.append(model_window)
        else:
            windows.append(None)
    return windows


def kv_shape(model: nn.Module) -> ModelShape:
    """What the budget math needs of a loaded model."""
    windows = tuple(w for w in layer_windows(model) if w is not None)
    return ModelShape.of(model, element_bytes=element_bytes(model), windows=windows)
