"""Attention kernels that export pre-softmax scores.

`sdpa_with_scores(q, k, v, scale, mask) -> (out, scores)` and its quantized twin
`quantized_sdpa_with_scores(q, k_q, v_q, scale, mask, group_size, bits)` run on the
backend a caller prefers (`backend=`: auto, reference, metal, cuda) where it fits the
shape, else on the reference (MLX ops, everywhere); `select_kvarn_backend` picks one for
KVarN storage the same way (kernels/kvarn.py has its reference). cache/attention.py
decides which backend the server prefers; `withdraw` takes one kind of call away from a
GPU backend whose start-up check failed (cache/kernel_check.py).
"""

from kernels.dispatch import (
    AUTO,
    BACKEND_NAMES,
    KINDS,
    available_backends,
    check_backend,
    get_backend,
    quantized_sdpa_with_scores,
    sdpa_with_scores,
    select_backend,
    select_kvarn_backend,
    select_prompt_backend,
    select_weights_backend,
    withdraw,
    withdrawn,
)

__all__ = [
    "AUTO",
    "BACKEND_NAMES",
    "KINDS",
    "available_backends",
    "check_backend",
    "get_backend",
    "quantized_sdpa_with_scores",
    "sdpa_with_scores",
    "select_backend",
    "select_kvarn_backend",
    "select_prompt_backend",
    "select_weights_backend",
    "withdraw",
    "withdrawn",
]
