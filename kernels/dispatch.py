"""Pick an attention backend per call: forced, else the first available that fits.

Order of preference: metal, cuda, reference. A backend is forced by `force_backend(name)`
(the `--kernel` flag) or, failing that, by the H2O_KERNEL environment variable, read on
every call; values: auto, reference, metal, cuda. Forcing a backend this machine lacks
raises ValueError. A forced GPU backend still hands shapes it does not support
(prefill chunks, odd head dims) to the reference, so a forced run never fails on them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from kernels import cuda, metal, reference
from kernels.reference import Mask, QuantizedTensor

AUTO = "auto"
ENV_VAR = "H2O_KERNEL"


@dataclass(frozen=True)
class Backend:
    is_available: Callable[[], bool]
    # supports(q, k, mask, group_size=..., bits=...): k is the keys or the packed key words.
    supports: Callable[..., bool]
    dense: Callable[..., tuple[mx.array, mx.array]]
    quantized: Callable[..., tuple[mx.array, mx.array]]


_BACKENDS: dict[str, Backend] = {
    "metal": Backend(
        metal.is_available, metal.supports, metal.sdpa_with_scores, metal.quantized_sdpa_with_scores
    ),
    "cuda": Backend(
        cuda.is_available, cuda.supports, cuda.sdpa_with_scores, cuda.quantized_sdpa_with_scores
    ),
    "reference": Backend(
        lambda: True,
        lambda *args, **kwargs: True,
        reference.sdpa_with_scores,
        reference.quantized_sdpa_with_scores,
    ),
}
BACKEND_NAMES = (AUTO, *_BACKENDS)

_forced: str | None = None


def force_backend(name: str | None) -> None:
    """Force a backend for every later call (None or "auto" undoes it; beats H2O_KERNEL)."""
    global _forced
    _forced = None if name in (None, AUTO) else _check_forcible(name, "force_backend")


def get_backend(name: str) -> Backend:
    """One backend's functions, called directly (benchmarks, tests); no fallback."""
    return _BACKENDS[_check_forcible(name, "backend")]


def available_backends() -> list[str]:
    return [name for name in _BACKENDS if _is_available(name)]


@cache
def _is_available(name: str) -> bool:
    # The device does not change while the process runs; decode asks once per layer.
    return _BACKENDS[name].is_available()


def select_backend(
    q: mx.array,
    k: mx.array,
    mask: Mask = None,
    *,
    group_size: int | None = None,
    bits: int | None = None,
) -> str:
    """The backend for this call (k: keys, or the packed key words when quantized)."""
    forced = _forced or os.environ.get(ENV_VAR, AUTO)
    if forced != AUTO:
        _check_forcible(forced, ENV_VAR)
        candidates = [forced]
    else:
        candidates = [name for name in _BACKENDS if name != "reference"]
    for name in candidates:
        if _is_available(name) and _BACKENDS[name].supports(
            q, k, mask, group_size=group_size, bits=bits
        ):
            return name
    return "reference"


def sdpa_with_scores(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask = None
) -> tuple[mx.array, mx.array]:
    """Attention output and float32 pre-softmax scores [B, n_q_heads, L_q, L_k]."""
    return _BACKENDS[select_backend(q, k, mask)].dense(q, k, v, scale, mask)


def quantized_sdpa_with_scores(
    q: mx.array,
    k_q: QuantizedTensor,
    v_q: QuantizedTensor,
    scale: float,
    mask: Mask = None,
    group_size: int = 64,
    bits: int = 8,
) -> tuple[mx.array, mx.array]:
    """`sdpa_with_scores` over K/V packed by `mx.quantize` as (weights, scales, biases)."""
    name = select_backend(q, k_q[0], mask, group_size=group_size, bits=bits)
    return _BACKENDS[name].quantized(q, k_q, v_q, scale, mask, group_size, bits)


def _check_forcible(name: str, source: str) -> str:
    if name not in _BACKENDS:
        raise ValueError(f"{source}={name!r}: known backends are {list(BACKEND_NAMES)}")
    if not _is_available(name):
        raise ValueError(
            f"{source}={name!r}: that backend is not available on this machine "
            f"(available: {available_backends()})"
        )
    return name
