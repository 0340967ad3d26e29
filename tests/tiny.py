"""Random-weight mlx-lm models small enough to build in milliseconds, for unit tests."""

from __future__ import annotations

import importlib

import mlx.core as mx

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": 64,
    "num_hidden_layers": 2,
}


def tiny(arch: str, **config):
    """A float32 `mlx_lm.models.<arch>` model of TINY's size (overridden by `config`)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict({**TINY, "model_type": arch, **config}))
    model.set_dtype(mx.float32)
    return model
