"""Pick an attention backend per call: forced by H2O_KERNEL, else the best available."""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx

from kernels import reference

Kernel = Callable[..., tuple[mx.array, mx.array]]

# name -> (is_available(), supports(q, k) , kernel); ordered by preference.
_BACKENDS: dict[str, tuple[Callable[[], bool], Callable[[mx.array, mx.array], bool], Kernel]] = {
    "reference": (lambda: True, lambda q, k: True, reference.sdpa_with_scores),
}


def available_backends() -> list[str]:
    return [name for name, (available, _, _) in _BACKENDS.items() if available()]


def select_backend(q: mx.array, k: mx.array) -> str:
    forced = os.environ.get("H2O_KERNEL", "auto")
    if forced != "auto":
        if forced not in _BACKENDS:
            raise ValueError(f"H2O_KERNEL={forced!r}: known backends are {sorted(_BACKENDS)}")
        return forced
    for name, (available, supports, _) in _BACKENDS.items():
        if name != "reference" and available() and supports(q, k):
            return name
    return "reference"


def sdpa_with_scores(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: reference.Mask = None
) -> tuple[mx.array, mx.array]:
    """Attention output and float32 pre-softmax scores [B, n_q_heads, L_q, L_k]."""
    kernel = _BACKENDS[select_backend(q, k)][2]
    return kernel(q, k, v, scale, mask)
