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

from kernels.hadamard import rotate
from kernels.src import KernelSource, assemble

# make_kernel(name, input_names, output_names, source) -> the mx.fast kernel callable.
MakeKernel = Callable[[str, Sequence[str], Sequence[str], KernelSource], Callable]
QuantizedTensor = tuple[mx.array, mx.array, mx.array]

HEAD_DIMS = (64, 128, 256)
GROUP_SIZES = (32, 64)
BITS = (4, 8)
KVARN_BITS = (2, 4, 8)
MAX_QUERY_LEN = 8  # decode kernels: prefill chunks go to the reference
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
N_WARPS = 8  # warps per threadgroup in pass 1
MAX_GRID_ROWS = 65535  # CUDA's limit on gridDim.y

MASK_NONE, MASK_BOOL, MASK_ADDITIVE, MASK_CAUSAL = 0, 1, 2, 3

_DENSE_INPUTS = ("queries", "keys", "values", "mask", "scale")


def _packed_inputs(*extra: str) -> tuple[str, ...]:
    """A packed kernel's inputs: the dense front pool, packed keys and values (words,
    scales, biases, then `extra` per side: KVarN's factors), the dense tail pool."""
    key, value = (
        [f"{side}_{n}" for n in ("words", "scales", "biases", *extra)] for side in ("key", "value")
    )
    return (
        "queries",
        "front_keys",
        "front_values",
        *key,
        *value,
        "tail_keys",
        "tail_values",
        "mask",
        "scale",
    )


_QUANTIZED_INPUTS = _packed_inputs()
_KVARN_INPUTS = _packed_inputs("factors")  # key_factors, value_factors
_INPUTS = {"dense": _DENSE_INPUTS, "quantized": _QUANTIZED_INPUTS, "kvarn": _KVARN_INPUTS}
_SINGLE_OUTPUTS = ("out", "scores")
PROMPT_THREADS = 256  # query rows (pass 1) or keys (pass 2) per threadgroup
_PROMPT_PASSES = {
    1: (("queries", "keys", "scale"), ("row_max", "row_sum")),
    2: (("queries", "keys", "row_max", "row_sum", "held", "scale"), ("weights",)),
}
_SPLIT_OUTPUTS = ("scores", "partial_out", "partial_max", "partial_sum")
WEIGHTS_THREADS = 256  # keys per turn of a decode-weights threadgroup (a power of two)
MAX_WEIGHT_ROWS = 64  # query rows per KV head it takes (its shared row statistics)


def supports(
    q: mx.array,
    k: mx.array,
    mask: object = None,
    *,
    group_size: int | None = None,
    bits: int | None = None,
    pools: Sequence[mx.array] = (),
) -> bool:
    """Whether the decode kernels handle this call (k: keys, or the packed key words;
    pools: the dense front and tail keys read with packed ones, [B, n_kv, n, D] each)."""
    if k.ndim != 4 or k.shape[2] < 1 or not _decode_query(q, k.shape[0], k.shape[1]):
        return False
    B, n_q, L_q, D = q.shape
    n_kv, L_k = k.shape[1], k.shape[2]
    if bits is not None or group_size is not None:
        if bits not in BITS or group_size not in GROUP_SIZES or k.dtype != mx.uint32:
            return False
        if k.shape[3] * 32 != D * bits:
            return False
    elif k.shape[3] != D or k.dtype not in DTYPES or pools:
        return False
    if not all(_fits_pool(x, (B, n_kv, D)) for x in pools):
        return False
    L_k += sum(x.shape[2] for x in pools)
    return _mask_supported(mask, (B, n_q, L_q, L_k))


def supports_prompt(q: mx.array, k: mx.array, mask: object, held: mx.array) -> bool:
    """Whether the prompt-weights kernel takes this call: dense keys [B, n_kv, L_k, D] of
    a kernel dtype and head dim, any number of query rows, no mask or a causal one, and
    float32 held scores [B, n_kv, >= L_k]."""
    if q.ndim != 4 or k.ndim != 4 or held.ndim != 3 or q.dtype not in DTYPES:
        return False
    B, n_q, L_q, D = q.shape
    n_kv, L_k = k.shape[1], k.shape[2]
    if D not in HEAD_DIMS or k.shape[0] != B or k.shape[3] != D or k.dtype not in DTYPES:
        return False
    if n_kv < 1 or n_q % n_kv or held.dtype != mx.float32 or L_q < 1 or L_k < 1:
        return False
    if held.shape[:2] != (B, n_kv) or held.shape[2] < L_k:
        return False
    if not (mask is None or (isinstance(mask, str) and mask == "causal" and L_k >= L_q)):
        return False
    rows = (n_q // n_kv) * L_q
    tiles = max(math.ceil(rows / PROMPT_THREADS), math.ceil(held.shape[2] / PROMPT_THREADS))
    return tiles <= MAX_GRID_ROWS and B * n_kv <= MAX_GRID_ROWS


def supports_decode_weights(scores: mx.array, held: mx.array) -> bool:
    """Whether the decode-weights kernel takes this step: float32 logits [B, n_q, L_q, L_k]
    of a decode (as the decode kernels export them) and float32 held scores [B, n_kv,
    >= L_k], the query heads grouped over the KV heads."""
    if scores.ndim != 4 or held.ndim != 3 or mx.float32 != scores.dtype or mx.float32 != held.dtype:
        return False
    B, n_q, L_q, L_k = scores.shape
    n_kv = held.shape[1]
    if held.shape[0] != B or held.shape[2] < L_k or n_kv < 1 or n_q % n_kv:
        return False
    rows = (n_q // n_kv) * L_q
    return 1 <= L_q <= MAX_QUERY_LEN and rows <= MAX_WEIGHT_ROWS and B * n_kv <= MAX_GRID_ROWS


def _decode_query(q: mx.array, batch: int, n_kv: int) -> bool:
    """q [B, n_q, L_q, D]: a kernel dtype and head dim, a decode's few query rows, the
    keys' batch, query heads grouped over n_kv KV heads, within the grid."""
    if q.ndim != 4 or q.dtype not in DTYPES:
        return False
    B, n_q, L_q, D = q.shape
    if D not in HEAD_DIMS or not 1 <= L_q <= MAX_QUERY_LEN or batch != B:
        return False
    return n_kv >= 1 and n_q % n_kv == 0 and B * n_q * L_q <= MAX_GRID_ROWS


def _fits_pool(x: mx.array, lead: tuple[int, int, int]) -> bool:
    """A dense pool read beside packed K/V: [B, n_kv, n, D] in a kernel dtype."""
    return x.ndim == 4 and (x.shape[0], x.shape[1], x.shape[3]) == lead and x.dtype in DTYPES


def supports_kvarn(q: mx.array, keys: list, mask: object, fmt) -> bool:
    """Whether the decode kernels handle this KVarN part (keys: [front, tiles, tail] with
    tiles present; fmt: kernels.kvarn.TileFormat)."""
    front, tiles, tail = keys
    if tiles is None or not _decode_query(q, tiles[0].shape[0], tiles[0].shape[1]):
        return False
    B, n_q, L_q, D = q.shape
    n_kv = tiles[0].shape[1]
    if tiles[0].shape[3] != D:  # key words [B, n_kv, n, D, tile * bits / 32]
        return False
    if fmt.key_bits not in KVARN_BITS or fmt.value_bits not in KVARN_BITS:
        return False
    if fmt.group_size not in GROUP_SIZES or D % fmt.group_size:
        return False
    if not all(_fits_pool(x, (B, n_kv, D)) for x in (front, tail) if x is not None):
        return False
    L_k = kvarn_length(keys, fmt.tile)
    return _mask_supported(mask, (B, n_q, L_q, L_k))


def kvarn_length(keys: list, tile: int) -> int:
    """Slots of a KVarN part: front, tiles and tail together."""
    front, tiles, tail = keys
    n = [0 if x is None else x.shape[2] for x in (front, tail)]
    return n[0] + tiles[0].shape[2] * tile + n[1]


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
    """The decode kernels of one dialect, and the prompt-weights kernel beside them, built
    on first use and cached per variant."""

    def __init__(self, dialect: str, make_kernel: MakeKernel):
        self.dialect = dialect
        self._make_kernel = make_kernel
        self._kernels: dict[tuple[str, bool], Callable] = {}
        self._combine: Callable | None = None
        self._prompt: dict[int, Callable] = {}
        self._weights: Callable | None = None

    def prompt_weights(
        self, q: mx.array, k: mx.array, scale: float, mask: object, held: mx.array
    ) -> mx.array:
        """`held` [B, n_kv, n >= L_k] plus each key's softmax weight summed over q's rows
        and the query heads of its KV head (the `attn` rule's update over a prompt chunk),
        in two launches over K: row max and sum, then column sums. No [L_q, L_k] array
        exists at any point; mask: None or "causal" (bottom-right)."""
        B, n_q, L_q, D = q.shape
        n_kv = k.shape[1]
        rows = (n_q // n_kv) * L_q
        scale_in = _scale_input(scale)
        mode = MASK_NONE if mask is None else MASK_CAUSAL
        constants = [("HEAD_DIM", D), ("N_THREADS", PROMPT_THREADS), ("MASK_MODE", mode)]
        threads = (PROMPT_THREADS, 1, 1)
        first = [q, k, scale_in]
        row_max, row_sum = self._prompt_pass(1)(
            inputs=first,
            template=constants + _input_dtypes(first),
            grid=(PROMPT_THREADS, math.ceil(rows / PROMPT_THREADS), B * n_kv),
            threadgroup=threads,
            output_shapes=[(B, n_q, L_q)] * 2,
            output_dtypes=[mx.float32] * 2,
        )
        second = [q, k, row_max, row_sum, held, scale_in]
        (weights,) = self._prompt_pass(2)(
            inputs=second,
            template=constants + _input_dtypes(second),
            grid=(PROMPT_THREADS, math.ceil(held.shape[2] / PROMPT_THREADS), B * n_kv),
            threadgroup=threads,
            output_shapes=[held.shape],
            output_dtypes=[mx.float32],
        )
        return weights

    def decode_weights(self, scores: mx.array, held: mx.array) -> mx.array:
        """`held` [B, n_kv, n >= L_k] plus each key's softmax weight summed over the query
        rows of its KV head, from a decode's exported logits `scores` [B, n_q, L_q, L_k]
        (masked keys -inf): the `attn` rule's update in one launch."""
        B, n_q, L_q, _ = scores.shape
        n_kv = held.shape[1]
        if self._weights is None:
            source = assemble("decode_weights", self.dialect)
            self._weights = self._make_kernel(
                "h2o_decode_weights", ("scores", "held"), ("weights",), source
            )
        inputs = [scores, held]
        (weights,) = self._weights(
            inputs=inputs,
            template=[
                ("N_THREADS", WEIGHTS_THREADS),
                ("N_ROWS", (n_q // n_kv) * L_q),
                *_input_dtypes(inputs),
            ],
            grid=(WEIGHTS_THREADS, 1, B * n_kv),
            threadgroup=(WEIGHTS_THREADS, 1, 1),
            output_shapes=[held.shape],
            output_dtypes=[mx.float32],
        )
        return weights

    def _prompt_pass(self, which: int) -> Callable:
        if which not in self._prompt:
            inputs, outputs = _PROMPT_PASSES[which]
            source = assemble("prompt_weights", self.dialect, {"PASS": which})
            self._prompt[which] = self._make_kernel(
                f"h2o_prompt_weights_{which}", inputs, outputs, source
            )
        return self._prompt[which]

    def dense(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        mask: object = None,
        n_blocks: int | None = None,
    ) -> tuple[mx.array, mx.array]:
        return self._attend(q, "dense", [k, v], {}, k.shape[2], scale, mask, n_blocks)

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
        front: tuple[mx.array, mx.array] | None = None,
        tail: tuple[mx.array, mx.array] | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Over K/V packed by mx.quantize, after a dense `front` (keys, values) and before
        a dense `tail` when given (a packed H2O cache's sink pool and newest tokens), in
        that slot order."""
        inputs, constants = _segments(front, k_q, v_q, tail)
        constants.update(BITS=bits, GROUP_SIZE=group_size)
        L_k = sum(x[0].shape[2] for x in (front, k_q, tail) if x is not None)
        return self._attend(q, "quantized", inputs, constants, L_k, scale, mask, n_blocks)

    def kvarn(
        self,
        q: mx.array,
        keys: list,
        values: list,
        scale: float,
        mask: object,
        fmt,
        n_blocks: int | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Attention over one KVarN part ([front, tiles, tail] per side, tiles present; fmt:
        kernels.kvarn.TileFormat), q and the output in the model's frame: the query is
        rotated once on the way in and the output once on the way out."""
        (k_front, k_tiles, k_tail), (v_front, v_tiles, v_tail) = keys, values
        front = None if k_front is None else (k_front, v_front)
        tail = None if k_tail is None else (k_tail, v_tail)
        inputs, constants = _segments(front, k_tiles, v_tiles, tail)
        constants.update(
            KEY_BITS=fmt.key_bits,
            VALUE_BITS=fmt.value_bits,
            TILE=fmt.tile,
            GROUP_SIZE=fmt.group_size,
        )
        L_k = kvarn_length(keys, fmt.tile)
        # Rotated in float32 (as the reference does): a half query rotated in half precision
        # would carry its rounding into every score.
        q_rot = rotate(q.astype(mx.float32))  # no op for a float32 query
        out, scores = self._attend(q_rot, "kvarn", inputs, constants, L_k, scale, mask, n_blocks)
        return rotate(out).astype(q.dtype), scores

    def _attend(
        self,
        q: mx.array,
        mode: str,
        kv: list[mx.array],
        constants: dict[str, int],
        L_k: int,
        scale: float,
        mask: object,
        n_blocks: int | None,
    ) -> tuple[mx.array, mx.array]:
        """Pass 1 (and the block merge when split) of kernel `mode`: dense, quantized or
        kvarn, whose K/V inputs `kv` are in that kernel's input order."""
        B, n_q, L_q, D = q.shape
        rows = B * n_q * L_q
        n_blocks = n_blocks or choose_blocks(rows, L_k)
        mask_array, mask_mode = _mask_input(mask, (B, n_q, L_q, L_k))
        split = n_blocks > 1
        kernel = self._pass1(mode, split)
        inputs = [q, *kv, mask_array, _scale_input(scale)]
        template = [
            ("T", q.dtype),
            ("HEAD_DIM", D),
            ("N_WARPS", N_WARPS),
            ("MASK_MODE", mask_mode),
            *constants.items(),
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

    def _pass1(self, mode: str, split: bool) -> Callable:
        key = (mode, split)
        if key not in self._kernels:
            name = f"h2o_decode_{mode}" + ("_split" * split)
            switches = {"QUANTIZED": mode == "quantized", "KVARN": mode == "kvarn", "SPLIT": split}
            source = assemble(
                "decode_attention", self.dialect, {k: int(v) for k, v in switches.items()}
            )
            outputs = _SPLIT_OUTPUTS if split else _SINGLE_OUTPUTS
            self._kernels[key] = self._make_kernel(name, _INPUTS[mode], outputs, source)
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


def _segments(front, k_packed, v_packed, tail) -> tuple[list[mx.array], dict[str, int]]:
    """A packed kernel's K/V inputs, [front K, front V, packed K.., packed V.., tail K,
    tail V] (an absent pool as a placeholder), and its HAS_FRONT / HAS_TAIL constants."""
    absent = (_placeholder(), _placeholder())
    inputs = [*(front or absent), *k_packed, *v_packed, *(tail or absent)]
    return inputs, {"HAS_FRONT": int(front is not None), "HAS_TAIL": int(tail is not None)}


@functools.cache
def _placeholder() -> mx.array:
    # For an input a call does not have (the mask, an absent front or tail pool): never read.
    return mx.zeros((1, 1, 1, 1), dtype=mx.bool_)


def _mask_input(mask: object, full_shape: tuple[int, int, int, int]) -> tuple[mx.array, int]:
    """The mask as a 4-D input (broadcast views cost no copy: the kernel reads strides)."""
    if mask is None or isinstance(mask, str):
        return _placeholder(), MASK_NONE if mask is None else MASK_CAUSAL
    mode = MASK_BOOL if mask.dtype == mx.bool_ else MASK_ADDITIVE
    return mx.broadcast_to(mask, full_shape), mode
