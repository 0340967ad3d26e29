"""Launching the decode kernels: shared by the Metal and CUDA backends.

A backend only supplies `make_kernel` (a thin wrapper over `mx.fast.metal_kernel` or
`mx.fast.cuda_kernel`); shapes, grids, template constants and mask handling live here,
so both dialects are driven exactly alike.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import mlx.core as mx

from kernels.src import KernelSource, assemble

# make_kernel(name, input_names, output_names, source) -> the mx.fast kernel callable.
MakeKernel = Callable[[str, Sequence[str], Sequence[str], KernelSource], Callable]
QuantizedTensor = tuple[mx.array, mx.array, mx.array]

HEAD_DIMS = (64, 128, 256)
GROUP_SIZES = (32, 64)
BITS = (4, 8)
MAX_QUERY_LEN = 8  # decode kernels: prefill chunks go to the reference
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
N_WARPS = 8  # warps per threadgroup in pass 1
MAX_GRID_ROWS = 65535  # CUDA's limit on gridDim.y

MASK_NONE, MASK_BOOL, MASK_ADDITIVE, MASK_CAUSAL = 0, 1, 2, 3

_DENSE_INPUTS = ("queries", "keys", "values", "mask", "scale")
_QUANTIZED_INPUTS = (
    "queries",
    "key_words",
    "key_scales",
    "key_biases",
    "value_words",
    "value_scales",
    "value_biases",
    "mask",
    "scale",
)
_SINGLE_OUTPUTS = ("out", "scores")
_SPLIT_OUTPUTS = ("scores", "partial_out", "partial_max", "partial_sum")


def supports(
    q: mx.array,
    k: mx.array,
    mask: object = None,
    *,
    group_size: int | None = None,
    bits: int | None = None,
) -> bool:
    """Whether the decode kernels handle this call (k: keys, or the packed key words)."""
    if q.ndim != 4 or k.ndim != 4 or q.dtype not in DTYPES:
        return False
    B, n_q, L_q, D = q.shape
    n_kv, L_k = k.shape[1], k.shape[2]
    if D not in HEAD_DIMS or not 1 <= L_q <= MAX_QUERY_LEN or L_k < 1:
        return False
    if k.shape[0] != B or n_kv < 1 or n_q % n_kv or B * n_q * L_q > MAX_GRID_ROWS:
        return False
    if bits is not None or group_size is not None:
        if bits not in BITS or group_size not in GROUP_SIZES or k.dtype != mx.uint32:
            return False
        if k.shape[3] * 32 != D * bits:
            return False
    elif k.shape[3] != D or k.dtype not in DTYPES:
        return False
    return _mask_supported(mask, (B, n_q, L_q, L_k))


def choose_blocks(rows: int, L_k: int) -> int:
    """Key blocks per query row: split long caches so that enough threadgroups run.

    A heuristic, untuned on hardware: aim for ~512 threadgroups, never less than 128
    keys (16 per warp) per block, at most 64 blocks.
    """
    if L_k < 256:
        return 1
    return max(1, min(math.ceil(512 / rows), L_k // 128, 64))


def fast_kernel_maker(api: str) -> MakeKernel:
    """Builds kernels through `mx.fast.<api>` (metal_kernel or cuda_kernel), looked up on use."""

    def make_kernel(
        name: str, input_names: Sequence[str], output_names: Sequence[str], src: KernelSource
    ) -> Callable:
        return getattr(mx.fast, api)(
            name=name,
            input_names=list(input_names),
            output_names=list(output_names),
            source=src.source,
            header=src.header,
            # The kernels index through strides: slices of a cache and broadcast masks
            # are read in place instead of being copied every decode step.
            ensure_row_contiguous=False,
        )

    return make_kernel


class DecodeKernels:
    """The decode kernels of one dialect, built on first use and cached per variant."""

    def __init__(self, dialect: str, make_kernel: MakeKernel):
        self.dialect = dialect
        self._make_kernel = make_kernel
        self._kernels: dict[tuple[bool, bool], Callable] = {}
        self._combine: Callable | None = None

    def dense(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        mask: object = None,
        n_blocks: int | None = None,
    ) -> tuple[mx.array, mx.array]:
        return self._attend(q, [k, v], {}, scale, mask, n_blocks)

    def quantized(
        self,
        q: mx.array,
        k_q: QuantizedTensor,
        v_q: QuantizedTensor,
        scale: float,
        mask: object = None,
        group_size: int = 64,
        bits: int = 8,
        n_blocks: int | None = None,
    ) -> tuple[mx.array, mx.array]:
        packed = [*k_q, *v_q]
        return self._attend(
            q, packed, {"BITS": bits, "GROUP_SIZE": group_size}, scale, mask, n_blocks
        )

    def _attend(
        self,
        q: mx.array,
        kv: list[mx.array],
        quantization: dict[str, int],
        scale: float,
        mask: object,
        n_blocks: int | None,
    ) -> tuple[mx.array, mx.array]:
        B, n_q, L_q, D = q.shape
        L_k = kv[0].shape[2]
        rows = B * n_q * L_q
        n_blocks = n_blocks or choose_blocks(rows, L_k)
        mask_array, mask_mode = _mask_input(mask, (B, n_q, L_q, L_k))
        quantized = bool(quantization)
        split = n_blocks > 1
        kernel = self._pass1(quantized, split)
        inputs = [q, *kv, mask_array, _scale_input(scale)]
        template = [
            ("T", q.dtype),
            ("HEAD_DIM", D),
            ("N_WARPS", N_WARPS),
            ("MASK_MODE", mask_mode),
            *quantization.items(),
            *_input_dtypes(inputs),
        ]
        threads = 32 * N_WARPS
        scores_shape = (B, n_q, L_q, L_k)
        if not split:
            out, scores = kernel(
                inputs=inputs,
                template=template,
                grid=(threads, rows, 1),
                threadgroup=(threads, 1, 1),
                output_shapes=[q.shape, scores_shape],
                output_dtypes=[q.dtype, mx.float32],
            )
            return out, scores
        scores, partial_out, partial_max, partial_sum = kernel(
            inputs=inputs,
            template=template,
            grid=(threads, rows, n_blocks),
            threadgroup=(threads, 1, 1),
            output_shapes=[scores_shape, (rows, n_blocks, D), (rows, n_blocks), (rows, n_blocks)],
            output_dtypes=[mx.float32] * 4,
        )
        (out,) = self._combine_kernel()(
            inputs=[partial_out, partial_max, partial_sum],
            template=[("T", q.dtype), ("HEAD_DIM", D)],
            grid=(D, rows, 1),
            threadgroup=(D, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )
        return out, scores

    def _pass1(self, quantized: bool, split: bool) -> Callable:
        key = (quantized, split)
        if key not in self._kernels:
            name = "h2o_decode_" + ("quantized" if quantized else "dense") + ("_split" * split)
            source = assemble(
                "decode_attention", self.dialect, {"QUANTIZED": int(quantized), "SPLIT": int(split)}
            )
            inputs = _QUANTIZED_INPUTS if quantized else _DENSE_INPUTS
            outputs = _SPLIT_OUTPUTS if split else _SINGLE_OUTPUTS
            self._kernels[key] = self._make_kernel(name, inputs, outputs, source)
        return self._kernels[key]

    def _combine_kernel(self) -> Callable:
        if self._combine is None:
            source = assemble("combine_blocks", self.dialect)
            inputs = ("partial_out", "partial_max", "partial_sum")
            self._combine = self._make_kernel("h2o_combine_blocks", inputs, ("out",), source)
        return self._combine


def _mask_supported(mask: object, full_shape: tuple[int, int, int, int]) -> bool:
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return False
    if mask.dtype != mx.bool_ and mask.dtype not in DTYPES:
        return False
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    return all(m in (1, f) for m, f in zip(shape, full_shape, strict=True))


def _input_dtypes(inputs: list[mx.array]) -> list[tuple[str, mx.Dtype]]:
    """Every input's dtype as a template argument (the body never reads them).

    mx.fast caches a compiled kernel by its name and template arguments, not by its
    inputs' dtypes: without these, a call with float16 scales or an additive float16
    mask would run a kernel compiled earlier for float32 ones, reading the wrong width.
    """
    return [(f"INPUT{i}_T", x.dtype) for i, x in enumerate(inputs)]


@functools.cache
def _scale_input(scale: float) -> mx.array:
    # One array per scale for the process: a decode step calls the kernel once per layer,
    # and a fresh array each time was one more host-to-device copy per call.
    return mx.array([scale], dtype=mx.float32)


@functools.cache
def _mask_placeholder() -> mx.array:
    # The kernels always take a mask input; without a mask this one is never read.
    return mx.zeros((1, 1, 1, 1), dtype=mx.bool_)


def _mask_input(mask: object, full_shape: tuple[int, int, int, int]) -> tuple[mx.array, int]:
    """The mask as a 4-D input (broadcast views cost no copy: the kernel reads strides)."""
    if mask is None or isinstance(mask, str):
        return _mask_placeholder(), MASK_NONE if mask is None else MASK_CAUSAL
    mode = MASK_BOOL if mask.dtype == mx.bool_ else MASK_ADDITIVE
    return mx.broadcast_to(mask, full_shape), mode
