"""CUDA decode kernels (MLX's CUDA backend) through `mx.fast.cuda_kernel`.

The kernel bodies are shared with the Metal backend (kernels/src); this module only
wires them to CUDA. Decode shapes only (`supports`); the dispatcher sends the rest to
the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from kernels.src import KernelSource, launch


def is_available() -> bool:
    """True where MLX was built with its CUDA backend and sees a GPU; never raises."""
    try:
        return bool(mx.cuda.is_available()) and hasattr(mx.fast, "cuda_kernel")
    except Exception:  # builds without CUDA may lack mx.cuda entirely
        return False


def _make_kernel(
    name: str, input_names: Sequence[str], output_names: Sequence[str], src: KernelSource
) -> Callable:
    return mx.fast.cuda_kernel(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        source=src.source,
        header=src.header,
        # The kernels index through strides: slices of a cache and broadcast masks
        # are read in place instead of being copied every decode step.
        ensure_row_contiguous=False,
    )


_kernels = launch.DecodeKernels("cuda", _make_kernel)
supports = launch.supports
# Same contracts as kernels.reference: (out, float32 pre-softmax scores).
sdpa_with_scores = _kernels.dense
quantized_sdpa_with_scores = _kernels.quantized
