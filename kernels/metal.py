"""Metal decode kernels (Apple GPUs) through `mx.fast.metal_kernel`.

The kernel bodies are shared with the CUDA backend (kernels/src); this module only
wires them to Metal. Decode shapes only (`supports`); the dispatcher sends the rest to
the reference.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.src import launch


def is_available() -> bool:
    """True on a Mac whose MLX has the Metal backend; never raises elsewhere."""
    try:
        return bool(mx.metal.is_available()) and hasattr(mx.fast, "metal_kernel")
    except Exception:  # a CPU-only build may lack the probe entirely
        return False


_kernels = launch.DecodeKernels("metal", launch.fast_kernel_maker("metal_kernel"))
supports = launch.supports
# Same contracts as kernels.reference: (out, float32 pre-softmax scores).
sdpa_with_scores = _kernels.dense
quantized_sdpa_with_scores = _kernels.quantized
supports_kvarn = launch.supports_kvarn
kvarn_sdpa_with_scores = _kernels.kvarn  # KVarN storage: [front, tiles, tail] per side
supports_prompt = launch.supports_prompt
prompt_weights = _kernels.prompt_weights  # a prompt's key weights in two passes over K
supports_decode_weights = launch.supports_decode_weights
decode_weights = _kernels.decode_weights  # a decode's key weights from its logits
