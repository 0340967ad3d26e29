"""Attention kernels that export pre-softmax scores.

`sdpa_with_scores(q, k, v, scale, mask) -> (out, scores)` dispatches to the
fastest correct backend for the device and shape. Only `reference` exists so
far; Metal and CUDA kernels register here when they land. Force a backend with
the H2O_KERNEL environment variable (`reference`, or `auto`).
"""

import config  # noqa: F401  (loads OpenBLAS before the first mlx import)

from kernels.dispatch import available_backends, sdpa_with_scores, select_backend

__all__ = ["available_backends", "select_backend", "sdpa_with_scores"]
