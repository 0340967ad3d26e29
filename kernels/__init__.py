"""Attention kernels that export pre-softmax scores.

`sdpa_with_scores(q, k, v, scale, mask) -> (out, scores)` and its quantized twin
`quantized_sdpa_with_scores(q, k_q, v_q, scale, mask, group_size, bits)` dispatch to the
fastest correct backend for the device and shape: metal (Apple GPUs), cuda (MLX's CUDA
backend), else reference (MLX ops, everywhere). Force one with `force_backend(name)` or
the H2O_KERNEL environment variable (auto, reference, metal, cuda).
"""

import config  # noqa: F401  (loads OpenBLAS before the first mlx import)

from kernels.dispatch import (
    BACKEND_NAMES,
    available_backends,
    force_backend,
    quantized_sdpa_with_scores,
    sdpa_with_scores,
    select_backend,
)

__all__ = [
    "BACKEND_NAMES",
    "available_backends",
    "force_backend",
    "quantized_sdpa_with_scores",
    "sdpa_with_scores",
    "select_backend",
]
