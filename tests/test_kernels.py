"""Attention kernels with score export.

- the reference against a float64 numpy oracle, and the quantized reference against the
  dense one on dequantized K/V;
- every kernel backend present against the reference: metal, cuda, and "emulated" (the
  shared Metal/CUDA bodies and launch code run on the CPU, so even a machine without a
  GPU executes the kernel logic);
- dispatch (auto, a named backend, fallbacks) and the attention object that holds the choice;
- source assembly: Metal and CUDA built from the same body text, and that text parsed as
  mx.fast would generate it.
"""

import itertools
import re
import subprocess
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from cache.policies.kvarn_tiles import encode_keys, encode_values
from cache.scores.base import per_kv_head
from kernels import cuda, dispatch, metal, reference
from kernels.kvarn import TileFormat, kvarn_sdpa_with_probs
from kernels.src import BODIES, EMULATOR_DIALECT, SRC_DIR, assemble, emulator, launch

GPU_BACKENDS = {"metal": metal, "cuda": cuda}
TOLERANCE = {mx.float32: 1e-5, mx.float16: 1e-3, mx.bfloat16: 1e-2}
MASKS = ("none", "bool", "additive", "causal")


# --- inputs ---------------------------------------------------------------------------


def make_inputs(
    L_k: int,
    D: int = 64,
    gqa: int = 3,
    L_q: int = 1,
    B: int = 1,
    n_kv: int = 2,
    mask: str = "none",
    seed: int = 0,
):
    """q, k, v (float32) and a mask of the named kind, broadcast forms included."""
    rng = np.random.default_rng(seed)
    n_q = n_kv * gqa
    q = mx.array(rng.standard_normal((B, n_q, L_q, D), dtype=np.float32))
    k = mx.array(rng.standard_normal((B, n_kv, L_k, D), dtype=np.float32))
    v = mx.array(rng.standard_normal((B, n_kv, L_k, D), dtype=np.float32))
    if mask == "none":
        m = None
    elif mask == "causal":
        m = "causal"
    elif mask == "bool":  # per batch, shared by heads; the last key always visible
        keep = rng.random((B, 1, L_q, L_k)) < 0.7
        keep[..., -1] = True
        m = mx.array(keep)
    else:  # additive, per head, shared by the batch; some keys at -inf
        bias = rng.standard_normal((1, n_q, L_q, L_k)).astype(np.float32)
        bias[..., : L_k - 1 : 3] = -np.inf
        m = mx.array(bias)
    return q, k, v, m


def query_len(L_k: int) -> int:
    # A causal mask needs L_q <= L_k, else the first query rows see no key at all.
    return 1 if L_k < 3 else 3


def quantize(x: mx.array, group_size: int, bits: int):
    return mx.quantize(x, group_size=group_size, bits=bits)


def dequantize(packed, group_size: int, bits: int) -> mx.array:
    return mx.dequantize(*packed, group_size=group_size, bits=bits)


# --- comparison -----------------------------------------------------------------------


def assert_close(actual: mx.array, expected, tol: float, what: str) -> None:
    a = np.array(actual.astype(mx.float32) if isinstance(actual, mx.array) else actual)
    e = np.array(expected.astype(mx.float32) if isinstance(expected, mx.array) else expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    # Masked scores must be -inf in both, at the same places.
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(e), err_msg=f"{what}: -inf")
    finite = ~np.isneginf(e)
    np.testing.assert_allclose(a[finite], e[finite], rtol=tol, atol=tol, err_msg=what)


def numpy_attention(q, k, v, scale, mask):
    """Independent float64 oracle: repeat KV heads for GQA, mask, softmax, weight V."""
    q, k, v = (np.array(x, dtype=np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = scale * q @ k.swapaxes(-1, -2)
    L_q, L_k = scores.shape[-2:]
    if isinstance(mask, str):
        keep = np.arange(L_k)[None] <= np.arange(L_k - L_q, L_k)[:, None]
        scores = np.where(keep, scores, -np.inf)
    elif mask is not None and mask.dtype == mx.bool_:
        scores = np.where(np.array(mask), scores, -np.inf)
    elif mask is not None:
        scores = scores + np.array(mask, dtype=np.float64)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ v, scores


# --- the reference against independent oracles -----------------------------------------


@pytest.mark.parametrize(
    "L_k, D, gqa, mask",
    [
        (1, 64, 1, "none"),
        (7, 128, 3, "causal"),
        (64, 64, 8, "bool"),
        (1000, 128, 3, "additive"),
        (4096, 64, 3, "none"),
    ],
)
def test_reference_matches_float64_numpy(L_k, D, gqa, mask):
    q, k, v, m = make_inputs(L_k, D, gqa, L_q=query_len(L_k), B=2, mask=mask)
    out, scores = reference.sdpa_with_scores(q, k, v, D**-0.5, m)
    want_out, want_scores = numpy_attention(q, k, v, D**-0.5, m)
    assert scores.dtype == mx.float32 and out.dtype == q.dtype
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, 1e-5, "out")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize(
    "L_k, D, gqa, mask",
    [
        (1, 64, 1, "none"),
        (7, 128, 3, "causal"),
        (64, 64, 8, "bool"),
        (1000, 128, 3, "additive"),
    ],
)
def test_quantized_reference_matches_dense_on_dequantized(L_k, D, gqa, mask, bits, group_size):
    q, k, v, m = make_inputs(L_k, D, gqa, L_q=query_len(L_k), B=2, mask=mask)
    k_q, v_q = quantize(k, group_size, bits), quantize(v, group_size, bits)
    out, scores = reference.quantized_sdpa_with_scores(q, k_q, v_q, D**-0.5, m, group_size, bits)
    want_out, want_scores = reference.sdpa_with_scores(
        q, dequantize(k_q, group_size, bits), dequantize(v_q, group_size, bits), D**-0.5, m
    )
    assert scores.dtype == mx.float32 and scores.shape == want_scores.shape
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, 1e-5, "out")


def test_quantized_reference_long_cache_half_precision():
    """4096 keys packed from float16 K/V; the oracle still computes in float32."""
    q, k, v, _ = make_inputs(4096, 64, 3)
    q, k, v = (x.astype(mx.float16) for x in (q, k, v))
    k_q, v_q = quantize(k, 64, 8), quantize(v, 64, 8)
    out, scores = reference.quantized_sdpa_with_scores(q, k_q, v_q, 0.125, None, 64, 8)
    # Dequantized with float32 scales and biases: exactly what the oracle computes.
    deq = [
        dequantize((w, s.astype(mx.float32), b.astype(mx.float32)), 64, 8) for w, s, b in (k_q, v_q)
    ]
    want_out, want_scores = reference.sdpa_with_scores(q.astype(mx.float32), *deq, 0.125)
    assert out.dtype == mx.float16 and scores.dtype == mx.float32
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, 1e-3, "out")


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
def test_packed_matmul_on_cuda_dequantizes_to_the_same_product(
    monkeypatch, transpose, bits, group_size
):
    """On CUDA the reference dequantizes instead of calling mx.quantized_matmul (which
    returned zeros for batched packed K/V there): both routes give one product."""
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((2, 3, 5, 64 if transpose else 40), dtype=np.float32))
    w = mx.array(rng.standard_normal((2, 3, 40, 64), dtype=np.float32))
    packed = quantize(w, group_size, bits)
    direct = reference.packed_matmul(x, packed, transpose, group_size, bits)
    monkeypatch.setattr(reference, "on_cuda", lambda: True)
    dequantized = reference.packed_matmul(x, packed, transpose, group_size, bits)
    assert dequantized.shape == direct.shape == (2, 3, 5, 40 if transpose else 64)
    assert_close(dequantized, direct, 1e-4, "product")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_keys_of_one_group_read_as_bytes_give_quantized_matmuls_product(bits, D, dtype):
    """The CPU reference reads 8- and 4-bit rows of one group as bytes (dense matmuls, a
    4-bit byte's low nibble the even channel, scale and bias folded in after; 4-bit from
    a slab's few sessions on) instead of mx.quantized_matmul: the same product, also
    over a slice of the packed rows (a cache's keys past its dense sink pool)."""
    rng = np.random.default_rng(2)
    B = reference.NIBBLE_KEYS_FROM_BATCH
    x = mx.array(rng.standard_normal((B, 3, 3, D), dtype=np.float32) * D**-0.5).astype(dtype)
    keys = mx.array(rng.standard_normal((B, 3, 260, D), dtype=np.float32))
    packed = [a[:, :, 4:] for a in quantize(keys, D, bits)]
    with mx.stream(mx.cpu):
        got = reference.packed_matmul(x, packed, True, D, bits)
        want = mx.quantized_matmul(x, *packed, transpose=True, group_size=D, bits=bits)
    assert got.dtype == dtype and got.shape == want.shape == (B, 3, 3, 256)
    assert_close(got.astype(mx.float32), want.astype(mx.float32), TOLERANCE[dtype], "product")


# --- every kernel backend present against the reference --------------------------------

# The Metal/CUDA launch code and kernel bodies, run on CPU fibers with the host dialect:
# on a machine without a GPU this is what executes the shared body text.
_emulated_kernels = launch.DecodeKernels(EMULATOR_DIALECT, emulator.make_kernel)
EMULATED = SimpleNamespace(
    is_available=lambda: emulator.compiler() is not None,
    supports=launch.supports,
    sdpa_with_scores=_emulated_kernels.dense,
    quantized_sdpa_with_scores=_emulated_kernels.quantized,
    supports_kvarn=launch.supports_kvarn,
    kvarn_sdpa_with_scores=_emulated_kernels.kvarn,
    supports_prompt=launch.supports_prompt,
    prompt_weights=_emulated_kernels.prompt_weights,
    supports_decode_weights=launch.supports_decode_weights,
    decode_weights=_emulated_kernels.decode_weights,
)
BACKENDS = {"metal": metal, "cuda": cuda, "emulated": EMULATED}
SKIP_REASONS = {
    "metal": "Metal needs an Apple GPU (mx.metal.is_available() is False)",
    "cuda": "MLX's CUDA backend is not present (mx.cuda.is_available() is False)",
    "emulated": "the CPU emulation of the kernel bodies needs a C++ compiler",
}


def on_backends(names, argnames: str = "", *axes: list):
    """Parametrize `name` (and `argnames`) over the backends of `names` present here x the
    product of `axes` (lists of tuples). Cases exist only for backends this machine runs;
    where none does, the test is one skipped case saying why, not one per combination.
    """
    names_here = [n for n in names if BACKENDS[n].is_available()]
    argnames = "name" + (f", {argnames}" if argnames else "")
    if not names_here:
        reason = "; ".join(SKIP_REASONS[n] for n in names)
        blank = (None,) * len(argnames.split(","))
        return pytest.mark.parametrize(
            argnames, [pytest.param(*blank, marks=pytest.mark.skip(reason=reason))]
        )
    cases = []
    for combo in itertools.product(*axes):
        values = tuple(v for part in combo for v in (part if isinstance(part, tuple) else (part,)))
        cases += [(name, *values) for name in names_here]
    return pytest.mark.parametrize(argnames, cases if axes else names_here)


def kernel_backend(name: str):
    return BACKENDS[name]


def check_dense(backend, L_k, D, gqa, mask, B=2, L_q=None, dtype=mx.float32, n_blocks=None):
    q, k, v, m = make_inputs(L_k, D, gqa, L_q=L_q or query_len(L_k), B=B, mask=mask)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    assert backend.supports(q, k, m)
    extra = {} if n_blocks is None else {"n_blocks": n_blocks}
    out, scores = backend.sdpa_with_scores(q, k, v, D**-0.5, m, **extra)
    # Half inputs: compared with the float32 reference on the same (upcast) values.
    up = [x.astype(mx.float32) for x in (q, k, v)]
    want_out, want_scores = reference.sdpa_with_scores(*up, D**-0.5, m)
    assert out.dtype == dtype and scores.dtype == mx.float32
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, TOLERANCE[dtype], "out")


def check_quantized(backend, L_k, D, gqa, mask, bits, group_size, B=2, L_q=None, dtype=mx.float32):
    q, k, v, m = make_inputs(L_k, D, gqa, L_q=L_q or query_len(L_k), B=B, mask=mask)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    k_q, v_q = quantize(k, group_size, bits), quantize(v, group_size, bits)
    assert backend.supports(q, k_q[0], m, group_size=group_size, bits=bits)
    out, scores = backend.quantized_sdpa_with_scores(q, k_q, v_q, D**-0.5, m, group_size, bits)
    want_out, want_scores = reference.quantized_sdpa_with_scores(
        q.astype(mx.float32), k_q, v_q, D**-0.5, m, group_size, bits
    )
    assert out.dtype == dtype and scores.dtype == mx.float32
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, TOLERANCE[dtype], "out")


GPU_MATRIX = list(itertools.product((1, 7, 64, 1000, 4096), (64, 128), (1, 3, 8), MASKS))


@on_backends(GPU_BACKENDS, "L_k, D, gqa, mask", GPU_MATRIX)
def test_gpu_dense_matches_reference(name, L_k, D, gqa, mask):
    check_dense(kernel_backend(name), L_k, D, gqa, mask)


@on_backends(GPU_BACKENDS, "L_k, D, gqa, mask, bits", GPU_MATRIX, [4, 8])
def test_gpu_quantized_matches_reference(name, L_k, D, gqa, mask, bits):
    group_size = 32 if gqa == 3 else 64
    check_quantized(kernel_backend(name), L_k, D, gqa, mask, bits, group_size)


@on_backends(GPU_BACKENDS, "dtype, D", [mx.float16, mx.bfloat16], [64, 128, 256])
def test_gpu_half_precision(name, dtype, D):
    backend = kernel_backend(name)
    check_dense(backend, 1000, D, 3, "bool", dtype=dtype)
    check_quantized(backend, 1000, D, 3, "bool", 4, 64, dtype=dtype)


# The emulator compiles one C++ file per kernel variant (~0.5 s each) and runs every GPU
# thread as a fiber: a cover of the matrix rather than its full product. Every L_k, head
# dim (256 too), GQA ratio, mask kind, bit width, group size, dtype and both passes.
EMULATED_DENSE = [
    # L_k, D, gqa, mask, B, dtype
    (1, 64, 1, "none", 2, mx.float32),
    (7, 128, 3, "causal", 2, mx.float32),
    (64, 64, 8, "bool", 2, mx.float32),
    (1000, 128, 3, "additive", 1, mx.float32),  # two-pass
    (4096, 64, 3, "bool", 1, mx.float32),  # two-pass, 32 blocks
    (300, 256, 3, "causal", 1, mx.float32),
    (64, 64, 3, "additive", 1, mx.float16),
]
EMULATED_QUANTIZED = [
    # L_k, D, gqa, mask, bits, group_size, B, dtype
    (1, 64, 3, "none", 4, 64, 2, mx.float32),
    (7, 128, 1, "causal", 8, 32, 2, mx.float32),
    (64, 64, 8, "additive", 4, 32, 2, mx.float32),
    (1000, 128, 3, "bool", 8, 64, 1, mx.float32),  # two-pass
    (4096, 64, 3, "none", 4, 32, 1, mx.float32),  # two-pass, 32 blocks
    (300, 256, 8, "bool", 8, 64, 1, mx.float32),
    (64, 128, 3, "causal", 8, 64, 1, mx.float16),
]


def case_ids(cases) -> list[str]:
    return ["-".join(str(x).removeprefix("mlx.core.") for x in case) for case in cases]


@pytest.mark.parametrize(
    "L_k, D, gqa, mask, B, dtype", EMULATED_DENSE, ids=case_ids(EMULATED_DENSE)
)
def test_emulated_dense_matches_reference(L_k, D, gqa, mask, B, dtype):
    L_q = 1 if L_k >= 1000 else None  # fewer query rows: fibers are slow
    check_dense(kernel_backend("emulated"), L_k, D, gqa, mask, B=B, L_q=L_q, dtype=dtype)


@pytest.mark.parametrize(
    "L_k, D, gqa, mask, bits, group_size, B, dtype",
    EMULATED_QUANTIZED,
    ids=case_ids(EMULATED_QUANTIZED),
)
def test_emulated_quantized_matches_reference(L_k, D, gqa, mask, bits, group_size, B, dtype):
    L_q = 1 if L_k >= 1000 else None  # fewer query rows: fibers are slow
    backend = kernel_backend("emulated")
    check_quantized(backend, L_k, D, gqa, mask, bits, group_size, B, L_q=L_q, dtype=dtype)


# --- a prompt's key weights without its logits (kernels/src/prompt_weights.body) ---------

EMULATED_PROMPT = [
    # L_q, L_k, held width, D, gqa, mask, dtype
    (20, 30, 30, 64, 2, "causal", mx.float32),  # a chunk after 10 held keys
    (20, 30, 41, 64, 2, "none", mx.float32),  # held slots past the keys are copied
    (300, 300, 320, 64, 3, "causal", mx.float32),  # row tiles span query heads
    (600, 600, 600, 64, 1, "causal", mx.float32),  # key groups skip rows that see none
    (7, 600, 640, 128, 1, "causal", mx.float16),
    (33, 33, 40, 256, 2, "causal", mx.float32),
    (40, 90, 90, 128, 3, "causal", mx.float16),
]


def check_prompt_weights(backend, L_q, L_k, width, D, gqa, mask, dtype, B=1):
    """held + each key's softmax weight summed over the rows and the query heads of its KV
    head, against the reference and a float64 numpy oracle of the same sums."""
    rng = np.random.default_rng(L_q * 1000 + L_k)
    n_kv = 2
    q = mx.array(rng.standard_normal((B, n_kv * gqa, L_q, D), dtype=np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, n_kv, L_k, D), dtype=np.float32)).astype(dtype)
    held = mx.array(rng.random((B, n_kv, width), dtype=np.float32))
    m = None if mask == "none" else mask
    assert backend.supports_prompt(q, k, m, held)
    got = backend.prompt_weights(q, k, D**-0.5, m, held)
    want = reference.prompt_weights(q.astype(mx.float32), k.astype(mx.float32), D**-0.5, m, held)
    assert got.dtype == mx.float32 and got.shape == held.shape
    assert_close(got, want, 1e-5 if dtype == mx.float32 else 1e-3, "weights")
    qn, kn = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k))
    logits = D**-0.5 * qn @ np.repeat(kn, gqa, axis=1).swapaxes(-1, -2)
    if m is not None:
        keep = np.arange(L_k)[None] <= np.arange(L_k - L_q, L_k)[:, None]
        logits = np.where(keep, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    sums = probs.reshape(B, n_kv, gqa * L_q, L_k).sum(axis=2)
    oracle = np.array(held, dtype=np.float64)
    oracle[..., :L_k] += sums
    np.testing.assert_allclose(np.array(got), oracle, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "L_q, L_k, width, D, gqa, mask, dtype", EMULATED_PROMPT, ids=case_ids(EMULATED_PROMPT)
)
def test_emulated_prompt_weights_match_reference(L_q, L_k, width, D, gqa, mask, dtype):
    check_prompt_weights(kernel_backend("emulated"), L_q, L_k, width, D, gqa, mask, dtype)


@on_backends(GPU_BACKENDS, "L_q, L_k, width, D, gqa, mask, dtype", EMULATED_PROMPT)
def test_gpu_prompt_weights_match_reference(name, L_q, L_k, width, D, gqa, mask, dtype):
    check_prompt_weights(kernel_backend(name), L_q, L_k, width, D, gqa, mask, dtype, B=2)


def test_prompt_weights_take_dense_keys_and_no_mask_or_a_causal_one():
    q, k = mx.zeros((1, 4, 8, 64)), mx.zeros((1, 2, 16, 64))
    held = mx.zeros((1, 2, 16))
    assert launch.supports_prompt(q, k, "causal", held) and launch.supports_prompt(q, k, None, held)
    assert not launch.supports_prompt(q, k, mx.ones((8, 16), dtype=mx.bool_), held)
    assert not launch.supports_prompt(q, k, "causal", held[..., :15])  # fewer slots than keys
    assert not launch.supports_prompt(q, k, "causal", held.astype(mx.float16))
    assert not launch.supports_prompt(q, k[:, :, :4], "causal", held)  # causal: L_k >= L_q
    assert not launch.supports_prompt(mx.zeros((1, 4, 8, 48)), mx.zeros((1, 2, 16, 48)), None, held)


# --- a decode's key weights from its logits (kernels/src/decode_weights.body) ------------

EMULATED_DECODE_WEIGHTS = [
    # L_q, L_k, held width, gqa, masked (every 3rd key), dtype of the attention's K/V
    (1, 40, 40, 1, False, mx.float32),
    (1, 129, 129, 4, True, mx.float32),  # a lone cache's slots, the free ones masked
    (1, 700, 750, 3, True, mx.float32),  # keys past a turn of the threads; held copied
    (3, 300, 300, 2, False, mx.float32),  # a few query positions per KV head
    (1, 257, 257, 4, True, mx.float16),  # through the half decode kernel
]


def check_decode_weights(backend, L_q, L_k, width, gqa, masked, dtype, B=2):
    """held + each key's softmax weight summed over the query rows of its KV head, from
    the logits the decode kernel exported, against the `attn` rule's update on the
    reference and a float64 numpy oracle; masked keys get nothing."""
    rng = np.random.default_rng(L_k * 10 + gqa)
    n_kv, D = 2, 64
    q = mx.array(rng.standard_normal((B, n_kv * gqa, L_q, D), dtype=np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, n_kv, L_k, D), dtype=np.float32)).astype(dtype)
    mask = mx.array(np.arange(L_k) % 3 != 1) if masked else None
    _, logits = backend.sdpa_with_scores(q, k, k, D**-0.5, mask)
    held = mx.array(rng.random((B, n_kv, width), dtype=np.float32))
    assert backend.supports_decode_weights(logits, held)
    got = backend.decode_weights(logits, held)
    assert got.dtype == mx.float32 and got.shape == held.shape
    want = held[..., :L_k] + per_kv_head(mx.softmax(logits, axis=-1, precise=True), n_kv)
    want = mx.concatenate([want, held[..., L_k:]], axis=-1)
    assert_close(got, want, 1e-5 if dtype == mx.float32 else 1e-3, "weights")
    assert_close(got, reference.decode_weights(logits, held), 1e-5, "weights")
    x = np.array(logits, dtype=np.float64)
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    oracle = np.array(held, dtype=np.float64)
    oracle[..., :L_k] += probs.reshape(B, n_kv, gqa * L_q, L_k).sum(axis=2)
    np.testing.assert_allclose(np.array(got), oracle, rtol=1e-5, atol=1e-5)
    if masked:  # the masked keys' held scores are copied unchanged
        off = np.arange(L_k) % 3 == 1
        kept = np.array(held)[..., :L_k][..., off]
        np.testing.assert_array_equal(np.array(got)[..., :L_k][..., off], kept)


@pytest.mark.parametrize(
    "L_q, L_k, width, gqa, masked, dtype",
    EMULATED_DECODE_WEIGHTS,
    ids=case_ids(EMULATED_DECODE_WEIGHTS),
)
def test_emulated_decode_weights_match_the_attn_rule(L_q, L_k, width, gqa, masked, dtype):
    check_decode_weights(kernel_backend("emulated"), L_q, L_k, width, gqa, masked, dtype)


@on_backends(GPU_BACKENDS, "L_q, L_k, width, gqa, masked, dtype", EMULATED_DECODE_WEIGHTS)
def test_gpu_decode_weights_match_the_attn_rule(name, L_q, L_k, width, gqa, masked, dtype):
    check_decode_weights(kernel_backend(name), L_q, L_k, width, gqa, masked, dtype)


def test_decode_weights_take_a_decodes_float32_logits():
    logits, held = mx.zeros((1, 4, 1, 16)), mx.zeros((1, 2, 16))
    assert launch.supports_decode_weights(logits, held)
    assert not launch.supports_decode_weights(logits, held[..., :15])  # fewer slots than keys
    assert not launch.supports_decode_weights(logits.astype(mx.float16), held)
    assert not launch.supports_decode_weights(logits, mx.zeros((1, 3, 16)))  # 4 heads over 3
    assert not launch.supports_decode_weights(mx.zeros((1, 4, 9, 16)), held)  # a prompt chunk


# --- packed K/V between dense pools: [front | packed | tail] -----------------------------

EMULATED_POOLED = [
    # front, packed, tail, D, gqa, mask, bits, group_size, L_q, dtype, key blocks
    (4, 40, 16, 64, 3, "none", 4, 64, 1, mx.float32, None),  # h2o-q4: sinks and tail
    (4, 252, 0, 128, 3, "bool", 8, 64, 1, mx.float32, 3),  # h2o-q8: sinks, two-pass
    (0, 30, 7, 64, 8, "causal", 8, 32, 3, mx.float32, None),  # mixed dense-recent
    (2, 20, 5, 64, 3, "additive", 4, 32, 1, mx.float16, 2),
]


def check_pooled(
    backend, front, packed, tail, D, gqa, mask, bits, group_size, L_q, dtype, n_blocks
):
    """One quantized kernel call over [dense front | packed | dense tail] against the
    reference over the same keys dequantized, in that order; pools are strided slices."""
    q, k, v, m = make_inputs(front + packed + tail, D, gqa, L_q=L_q, mask=mask)
    q = q.astype(dtype)
    k_q, v_q = (quantize(x[:, :, front : front + packed], group_size, bits) for x in (k, v))
    pools = {}
    for name, a, b in (("front", 0, front), ("tail", front + packed, front + packed + tail)):
        if b > a:  # a view into a larger buffer, as a cache hands its pools over
            pools[name] = tuple(
                mx.concatenate([x, x], axis=2)[:, :, a:b].astype(dtype) for x in (k, v)
            )
    pool_keys = [p[0] for p in pools.values()]
    assert backend.supports(q, k_q[0], m, group_size=group_size, bits=bits, pools=pool_keys)
    extra = {} if n_blocks is None else {"n_blocks": n_blocks}
    out, scores = backend.quantized_sdpa_with_scores(
        q, k_q, v_q, D**-0.5, m, group_size, bits, **extra, **pools
    )
    dense = []
    for i, x in enumerate((k_q, v_q)):
        parts = [mx.dequantize(*x, group_size=group_size, bits=bits)]
        if "front" in pools:
            parts.insert(0, pools["front"][i].astype(mx.float32))
        if "tail" in pools:
            parts.append(pools["tail"][i].astype(mx.float32))
        dense.append(mx.concatenate(parts, axis=2))
    want_out, want_scores = reference.sdpa_with_scores(q.astype(mx.float32), *dense, D**-0.5, m)
    assert out.dtype == dtype and scores.shape == want_scores.shape
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, TOLERANCE[dtype], "out")


POOLED_ARGS = "front, packed, tail, D, gqa, mask, bits, group_size, L_q, dtype, n_blocks"


@pytest.mark.parametrize(POOLED_ARGS, EMULATED_POOLED, ids=case_ids(EMULATED_POOLED))
def test_emulated_quantized_reads_dense_pools_in_slot_order(
    front, packed, tail, D, gqa, mask, bits, group_size, L_q, dtype, n_blocks
):
    """A packed H2O cache's sink pool and newest tokens read beside its packed slots."""
    backend = kernel_backend("emulated")
    check_pooled(backend, front, packed, tail, D, gqa, mask, bits, group_size, L_q, dtype, n_blocks)


@on_backends(GPU_BACKENDS, POOLED_ARGS, EMULATED_POOLED)
def test_gpu_quantized_reads_dense_pools_in_slot_order(
    name, front, packed, tail, D, gqa, mask, bits, group_size, L_q, dtype, n_blocks
):
    backend = kernel_backend(name)
    check_pooled(backend, front, packed, tail, D, gqa, mask, bits, group_size, L_q, dtype, n_blocks)


def test_pools_must_fit_the_packed_keys():
    q, k, _, m = make_inputs(40, 64, 3, mask="bool")
    k_q = quantize(k[:, :, 4:], 64, 4)
    assert not launch.supports(q, k_q[0], m, group_size=64, bits=4)  # the mask covers 40 keys
    assert launch.supports(q, k_q[0], m, group_size=64, bits=4, pools=[k[:, :, :4]])
    assert not launch.supports(q, k_q[0], None, group_size=64, bits=4, pools=[k[:, :1, :4]])
    assert not launch.supports(q, k_q[0], None, group_size=64, bits=4, pools=[k_q[0][:, :, :4]])
    assert not launch.supports(q, k, None, pools=[k[:, :, :4]])  # dense keys take no pools


# --- KVarN storage: [dense front | packed tiles | dense tail] ---------------------------


def make_kvarn(segments, D, gqa, mask, fmt, L_q=1, dtype=mx.float32, seed=3):
    """q and KVarN keys/values [front, tiles, tail] (front/tail None when empty; the tail
    a slice of a larger pool, as a cache hands it over), with a mask of the named kind."""
    n_front, n_tiles, n_tail = segments
    L_k = n_front + n_tiles * fmt.tile + n_tail
    q, k, v, m = make_inputs(L_k, D, gqa, L_q=L_q, mask=mask, seed=seed)
    sides = []
    for x, encode in ((k, encode_keys), (v, encode_values)):
        tiles = x[:, :, n_front : n_front + n_tiles * fmt.tile]
        tiles = encode(tiles.reshape(*x.shape[:2], n_tiles, fmt.tile, D), fmt)
        front = x[:, :, :n_front].astype(dtype) if n_front else None
        pool = mx.concatenate([x[:, :, L_k - n_tail :], mx.zeros_like(x[:, :, :3])], axis=2)
        tail = pool[:, :, :n_tail].astype(dtype) if n_tail else None
        sides.append([front, tiles, tail])
    return q.astype(dtype), sides[0], sides[1], m


def check_kvarn(backend, segments, D, gqa, mask, fmt, L_q=1, dtype=mx.float32, n_blocks=None):
    q, keys, values, m = make_kvarn(segments, D, gqa, mask, fmt, L_q, dtype)
    assert backend.supports_kvarn(q, keys, m, fmt)
    extra = {} if n_blocks is None else {"n_blocks": n_blocks}
    out, scores = backend.kvarn_sdpa_with_scores(q, keys, values, D**-0.5, m, fmt, **extra)
    up = [
        [None if x is None else x.astype(mx.float32) for x in (s[0], s[2])] for s in (keys, values)
    ]
    want_out, want_scores, _ = kvarn_sdpa_with_probs(
        q.astype(mx.float32),
        [up[0][0], keys[1], up[0][1]],
        [up[1][0], values[1], up[1][1]],
        D**-0.5,
        m,
        fmt,
    )
    assert out.dtype == dtype and scores.dtype == mx.float32
    assert out.shape == q.shape and scores.shape == (*q.shape[:3], want_scores.shape[-1])
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, TOLERANCE[dtype], "out")


EMULATED_KVARN = [
    # (front, tiles, tail), D, gqa, mask, (tile, key bits, value bits, value group), L_q,
    # dtype, key blocks
    ((4, 2, 5), 64, 3, "none", (32, 4, 2, 32), 1, mx.float32, None),  # h2o-kvarn k4v2
    ((0, 1, 0), 128, 1, "causal", (64, 4, 4, 64), 3, mx.float32, None),  # tiles alone
    ((128, 2, 17), 64, 8, "bool", (128, 2, 2, 32), 1, mx.float16, None),  # kvarn k2v2
    ((4, 3, 31), 64, 3, "additive", (32, 8, 4, 32), 2, mx.float32, 4),  # two-pass
    ((0, 2, 9), 256, 3, "none", (64, 4, 2, 64), 1, mx.float32, None),  # no front
]


@pytest.mark.parametrize(
    "segments, D, gqa, mask, fmt, L_q, dtype, n_blocks",
    EMULATED_KVARN,
    ids=case_ids(EMULATED_KVARN),
)
def test_emulated_kvarn_matches_reference(segments, D, gqa, mask, fmt, L_q, dtype, n_blocks):
    """The decode kernel over KVarN storage (tiles dequantized in registers, the query
    rotated in and the output out once) gives the reference's scores and output, with or
    without a front or a tail pool, over every width, tile and value group."""
    fmt = TileFormat(*fmt)
    check_kvarn(kernel_backend("emulated"), segments, D, gqa, mask, fmt, L_q, dtype, n_blocks)


GPU_KVARN = [
    *EMULATED_KVARN,
    ((128, 16, 100), 128, 3, "bool", (128, 4, 2, 32), 1, mx.bfloat16, None),  # kvarn, 2.3k
    ((4, 4, 63), 64, 3, "causal", (64, 4, 2, 32), 4, mx.float32, None),  # h2o-kvarn, chunk
]


@on_backends(GPU_BACKENDS, "segments, D, gqa, mask, fmt, L_q, dtype, n_blocks", GPU_KVARN)
def test_gpu_kvarn_matches_reference(name, segments, D, gqa, mask, fmt, L_q, dtype, n_blocks):
    fmt = TileFormat(*fmt)
    check_kvarn(kernel_backend(name), segments, D, gqa, mask, fmt, L_q, dtype, n_blocks)


def test_kvarn_kernel_supports_decode_shapes_only():
    fmt = TileFormat(32, 4, 2, 32)
    q, keys, _, m = make_kvarn((4, 2, 5), 64, 3, "bool", fmt)
    assert launch.supports_kvarn(q, keys, m, fmt)
    assert launch.supports_kvarn(q, keys, "causal", fmt)
    assert not launch.supports_kvarn(q, [keys[0], None, keys[2]], None, fmt)  # no tiles
    q_long, keys_long, _, _ = make_kvarn((4, 2, 5), 64, 3, "none", fmt, L_q=16)
    assert not launch.supports_kvarn(q_long, keys_long, None, fmt)  # a prefill chunk
    assert not launch.supports_kvarn(q, keys, None, TileFormat(32, 4, 2, 128))  # value group
    assert not launch.supports_kvarn(q, keys, mx.zeros((2, 1, 3), dtype=mx.bool_), fmt)


@on_backends(BACKENDS, "n_blocks", [1, 2, 5, 64])
def test_split_over_key_blocks(name, n_blocks):
    """Single pass and two-pass give the reference's result, empty blocks (64) included."""
    check_dense(kernel_backend(name), 300, 64, 8, "additive", B=1, L_q=2, n_blocks=n_blocks)


@on_backends(BACKENDS)
def test_strided_views(name):
    """Cache slices and transposed queries are read through strides, not copied."""
    backend = kernel_backend(name)
    _, k, v, _ = make_inputs(96, 64, 3, mask="none")
    q = mx.random.normal((1, 1, 6, 64)).transpose(0, 2, 1, 3)  # [B, H, L_q, D] view
    k, v = k[:, :, 10:70], v[:, :, 10:70]
    out, scores = backend.sdpa_with_scores(q, k, v, 0.125)
    want_out, want_scores = reference.sdpa_with_scores(q, k, v, 0.125)
    assert_close(scores, want_scores, 1e-5, "scores")
    assert_close(out, want_out, 1e-5, "out")


MASK_SHAPES = [(6, 2, 50), (6, 1, 50), (2, 1, 1, 50), (2, 6, 1, 50), (1, 50), (2, 50)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_reference_broadcasts_masks_like_numpy(shape):
    q, k, v, _ = make_inputs(50, 64, 3, L_q=2, B=2)  # scores [2, 6, 2, 50]
    keep = mx.random.uniform(shape=shape, key=mx.random.key(1)) < 0.7
    full = mx.broadcast_to(keep, (2, 6, 2, 50))
    want_out, want_scores = numpy_attention(q, k, v, 0.1, full)
    for m in (keep, mx.where(keep, 0.0, -mx.inf)):  # boolean and additive forms
        out, scores = reference.sdpa_with_scores(q, k, v, 0.1, m)
        assert_close(scores, want_scores, 1e-5, "scores")
        assert_close(out, want_out, 1e-5, "out")


@on_backends(BACKENDS)
def test_kernel_broadcasts_masks(name):
    backend = kernel_backend(name)
    q, k, v, _ = make_inputs(50, 64, 3, L_q=2, B=2)
    for shape in MASK_SHAPES:
        keep = mx.random.uniform(shape=shape, key=mx.random.key(2)) < 0.7
        for m in (keep, mx.where(keep, 0.0, -mx.inf)):
            assert backend.supports(q, k, m)
            out, scores = backend.sdpa_with_scores(q, k, v, 0.1, m)
            want_out, want_scores = reference.sdpa_with_scores(q, k, v, 0.1, m)
            assert_close(scores, want_scores, 1e-5, f"scores, mask {shape}")
            assert_close(out, want_out, 1e-5, f"out, mask {shape}")


# --- shape support ---------------------------------------------------------------------


def test_supports_decode_shapes_only():
    q, k, _, m = make_inputs(64, 64, 3, mask="bool")
    assert launch.supports(q, k, m)
    assert launch.supports(q, k, "causal")
    k_q = quantize(k, 64, 4)
    assert launch.supports(q, k_q[0], group_size=64, bits=4)
    assert not launch.supports(q, k_q[0], group_size=128, bits=4)  # untested group size
    assert not launch.supports(q, k_q[0], group_size=64, bits=8)  # words do not fit D
    q96, k96, _, _ = make_inputs(8, 96, 1)
    assert not launch.supports(q96, k96)  # head dim
    q_long, k_long, _, _ = make_inputs(64, 64, 3, L_q=16)
    assert not launch.supports(q_long, k_long)  # a prefill chunk
    assert not launch.supports(q, k, mx.zeros((2, 1, 64), dtype=mx.bool_))  # not broadcastable
    assert not launch.supports(q, k, "sliding")


def test_split_heuristic():
    assert launch.choose_blocks(rows=9, L_k=64) == 1
    assert launch.choose_blocks(rows=9, L_k=4096) == 32
    assert launch.choose_blocks(rows=4096, L_k=4096) == 1
    assert 1 <= launch.choose_blocks(rows=1, L_k=10**6) <= 64


# --- dispatch --------------------------------------------------------------------------


def unavailable_backend() -> str:
    missing = [name for name in GPU_BACKENDS if not GPU_BACKENDS[name].is_available()]
    if not missing:
        pytest.skip("every backend is available here")
    return missing[0]


def test_available_backends_are_exactly_the_ones_present():
    gpus = {name for name, b in GPU_BACKENDS.items() if b.is_available()}
    assert set(dispatch.available_backends()) == gpus | {"reference"}


def test_dispatch_auto_picks_an_available_backend():
    q, k, v, _ = make_inputs(64, 64, 3)
    name = dispatch.select_backend("auto", q, k)
    assert name in dispatch.available_backends()
    if name == "reference":  # no GPU: the dispatched call is the reference itself
        got = dispatch.sdpa_with_scores(q, k, v, 0.125)
        want = reference.sdpa_with_scores(q, k, v, 0.125)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
    # Prefill-sized queries and split K/V widths always go to the reference.
    q_long, k_long, _, _ = make_inputs(64, 64, 3, L_q=32)
    assert dispatch.select_backend("auto", q_long, k_long) == "reference"
    k_w = mx.zeros((1, 2, 64, 16), dtype=mx.uint32)
    split = dispatch.select_backend("auto", q, k_w, group_size=64, bits=8, value_bits=4)
    assert split == "reference"


def test_a_named_backend_is_checked_once_where_it_is_chosen():
    """The attention object validates its backend when configured, not on every call."""
    from cache.attention import ScoredAttention

    with pytest.raises(ValueError, match="known backends"):
        ScoredAttention(backend="no-such-kernel")
    with pytest.raises(ValueError, match="not available"):
        ScoredAttention(backend=unavailable_backend())
    attention = ScoredAttention(backend="reference")
    with pytest.raises(ValueError, match="not available"):
        attention.configure(backend=unavailable_backend())
    assert attention.backend == "reference"  # a refused change leaves the choice as it was
    q, k, _, _ = make_inputs(7, 64, 3)
    assert dispatch.select_backend("reference", q, k) == "reference"


def test_get_backend():
    assert dispatch.get_backend("reference").quantized is reference.quantized_sdpa_with_scores
    with pytest.raises(ValueError, match="not available"):
        dispatch.get_backend(unavailable_backend())


def test_dispatch_quantized():
    q, k, v, m = make_inputs(64, 64, 3, mask="causal", L_q=3)
    k_q, v_q = quantize(k, 32, 4), quantize(v, 32, 4)
    got = dispatch.quantized_sdpa_with_scores(q, k_q, v_q, 0.125, m, 32, 4, backend="reference")
    want = reference.quantized_sdpa_with_scores(q, k_q, v_q, 0.125, m, 32, 4)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


# --- source assembly: Metal and CUDA compile the same body text ------------------------

# Words that belong to one dialect and must stay out of the shared bodies.
DIALECT_WORDS = (
    "simd_",
    "simdgroup",
    "threadgroup",
    "metal::",
    "device ",
    "constant ",
    "__shfl",
    "__syncthreads",
    "__shared__",
    "__device__",
    "threadIdx",
    "blockIdx",
    "gridDim",
    "__half",
    "expf",
    "half",
)


@pytest.mark.parametrize("body", BODIES)
def test_metal_and_cuda_sources_share_the_body(body):
    text = (SRC_DIR / f"{body}.body").read_text()
    common = (SRC_DIR / "common.h").read_text()
    defines = {"QUANTIZED": 1, "SPLIT": 1} if body == "decode_attention" else {}
    sources = {d: assemble(body, d, defines) for d in ("metal", "cuda", EMULATOR_DIALECT)}
    for dialect, src in sources.items():  # the emulator runs the very same text
        assert src.source.endswith(text), dialect
        assert common in src.header, dialect
    for word in DIALECT_WORDS:
        assert word not in text and word not in common, f"{word!r} leaked into shared code"
    # Metal's generated signature gets each thread attribute only if the source names it.
    for attribute in ("thread_index_in_simdgroup", "threadgroup_position_in_grid"):
        assert attribute in sources["metal"].source
    assert "threadIdx" in sources["cuda"].source
    assert "__shfl_xor_sync" in sources["cuda"].header


@pytest.mark.parametrize("dialect", ["cuda", EMULATOR_DIALECT])
def test_dialects_declare_what_metal_declares(dialect):
    """Same thread coordinates in every prologue; same macros and helpers in every header."""

    def coordinates(d: str) -> set[str]:
        return set(re.findall(r"const int (\w+) =", (SRC_DIR / f"prologue_{d}.inc").read_text()))

    def macros(d: str) -> set[str]:
        text = (SRC_DIR / f"dialect_{d}.h").read_text()
        return set(re.findall(r"#define (\w+)", text)) | set(
            re.findall(r"float (warp_\w+)\(", text)
        )

    assert coordinates(dialect) == coordinates("metal")
    assert coordinates("metal") == {"tid", "lane", "warp", "group_y", "group_z", "n_groups_z"}
    assert macros(dialect) == macros("metal")


def test_assemble_rejects_unknown_names():
    with pytest.raises(ValueError):
        assemble("decode_attention", "opencl")
    with pytest.raises(ValueError):
        assemble("prefill", "metal")


# --- syntax of the kernels exactly as MLX would generate them ---------------------------
# No Metal or CUDA compiler here: rebuild the full kernel text the way mx.fast does
# (mlx/backend/common/metal_kernel.cpp, mlx/backend/cuda/custom_kernel.cpp, MLX 0.32) and
# parse it with the host C++ compiler against stub headers. Metal is C++14-based, so its
# text is checked as C++14. Catches syntax, typing and template slips, not semantics.

METAL_ATTRIBUTES = {
    "simdgroup_index_in_threadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "thread_position_in_grid": "uint3",
}
METAL_TYPES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.bool_: "bool",
    mx.uint32: "uint32_t",
}
CUDA_TYPES = {**METAL_TYPES, mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}

_HALF_STUB = """
struct {name} {{
  {name}() = default;
  {name}(float) {{}}
  operator float() const {{ return 0.0f; }}
}};
"""
METAL_STUBS = {
    "metal_stdlib": "#pragma once\n#include <cmath>\n#include <cstdint>\n"
    "#define device\n#define constant\n#define threadgroup\n"
    "typedef unsigned int uint;\nstruct uint3 { uint x, y, z; };\n"
    + _HALF_STUB.format(name="float16_t")
    + _HALF_STUB.format(name="bfloat16_t")
    + "namespace metal {\ninline float max(float a, float b) { return a > b ? a : b; }\n"
    "namespace precise { inline float exp(float x) { return std::exp(x); } }\n"
    "enum class mem_flags { mem_none, mem_threadgroup };\n"
    "inline void threadgroup_barrier(mem_flags) {}\n}\n",
    "metal_simdgroup": "#pragma once\n#include <metal_stdlib>\n"
    "namespace metal { inline float simd_sum(float x) { return x; } }\n",
}
CUDA_STUBS = {
    "mlx/backend/cuda/device/utils.cuh": "#pragma once\n#include <array>\n#include <cmath>\n"
    "#include <cstdint>\n#define __global__\n#define __device__\n#define __forceinline__ inline\n"
    "#define __shared__ static\n#define __grid_constant__\n"
    "struct dim3 { unsigned x, y, z; };\nextern dim3 threadIdx, blockIdx, gridDim;\n"
    "inline void __syncthreads() {}\n"
    "inline float __shfl_xor_sync(unsigned, float x, int) { return x; }\n"
    "inline float __int_as_float(int) { return 0.0f; }\n"
    + _HALF_STUB.format(name="__half")
    + _HALF_STUB.format(name="__nv_bfloat16")
    + "namespace mlx::core::cu {\nusing Shape = std::array<int32_t, 8>;\n"
    "using Strides = std::array<int64_t, 8>;\n}\n",
    "cooperative_groups.h": "#pragma once\nnamespace cooperative_groups {}\n",
}


def metal_kernel_text(name, input_names, output_names, src, inputs, template, output_dtypes):
    """What mx.fast.metal_kernel compiles (write_signature + the explicit instantiation)."""
    params = []
    for n, x in zip(input_names, inputs, strict=True):
        space = "constant" if x.size < 8 else "device"
        params.append(f"const {space} {METAL_TYPES[x.dtype]}* {n}")
        if n + "_shape" in src.source:
            params.append(f"const constant int* {n}_shape")
        if n + "_strides" in src.source:
            params.append(f"const constant int64_t* {n}_strides")
    params += [
        f"device {METAL_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes, strict=True)
    ]
    params += [f"{t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES.items() if a in src.source]
    kinds = ", ".join(("typename " if isinstance(v, mx.Dtype) else "int ") + k for k, v in template)
    values = ", ".join(METAL_TYPES[v] if isinstance(v, mx.Dtype) else str(v) for _, v in template)
    fn = f"custom_kernel_{name}"
    return (
        f"{src.header}template <{kinds}>\n[[kernel]] void {fn}(\n  "
        + ",\n  ".join(params)
        + f") {{\n{src.source}\n}}\n"
        f'template [[host_name("{fn}")]] [[kernel]] decltype({fn}<{values}>) {fn}<{values}>;\n'
    )


def cuda_kernel_text(name, input_names, output_names, src, inputs, template, output_dtypes):
    """What mx.fast.cuda_kernel compiles (build_kernel)."""
    params = []
    for n, x in zip(input_names, inputs, strict=True):
        params.append(f"const {CUDA_TYPES[x.dtype]}* {n}")
        if n + "_shape" in src.source:
            params.append(f"const __grid_constant__ Shape {n}_shape")
        if n + "_strides" in src.source:
            params.append(f"const __grid_constant__ Strides {n}_strides")
    params += [f"{CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes, strict=True)]
    constants = "".join(
        f"  using {k} = {CUDA_TYPES[v]};\n"
        if isinstance(v, mx.Dtype)
        else f"  constexpr int {k} = {v};\n"
        for k, v in template
    )
    return (
        '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
        f"{src.header}namespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
        f"__global__ void custom_kernel_{name}(\n    "
        + ",\n    ".join(params)
        + f") {{\n{constants}\n{src.source}\n}}\n}} // namespace mlx::core::cu\n"
    )


def recorded_kernel_texts(dialect: str, dtype) -> list[str]:
    """Drive the real launch code with a recording make_kernel; return the kernel texts."""
    texts = []
    build = metal_kernel_text if dialect == "metal" else cuda_kernel_text

    def make_kernel(name, input_names, output_names, src):
        def kernel(*, inputs, template, output_shapes, output_dtypes, **_):
            texts.append(
                build(name, input_names, output_names, src, inputs, template, output_dtypes)
            )
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return kernel

    kernels = launch.DecodeKernels(dialect, make_kernel)
    q, k, v, m = make_inputs(1000, 128, 3, mask="bool")
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    k_q, v_q = quantize(k, 64, 4), quantize(v, 64, 4)
    fmt = TileFormat(32, 4, 2, 32)
    q_t, keys, values, _ = make_kvarn((4, 2, 5), 128, 3, "none", fmt, dtype=dtype)
    no_front = [[None, *side[1:]] for side in (keys, values)]
    for n_blocks in (1, 4):  # single pass; two passes
        kernels.dense(q, k, v, 0.1, m, n_blocks=n_blocks)
        kernels.quantized(q, k_q, v_q, 0.1, "causal", 64, 4, n_blocks=n_blocks)
        kernels.kvarn(q_t, keys, values, 0.1, None, fmt, n_blocks=n_blocks)
        kernels.kvarn(q_t, *no_front, 0.1, "causal", fmt, n_blocks=n_blocks)  # a placeholder
        pools = {"front": (k[:, :, :4], v[:, :, :4]), "tail": (k[:, :, -16:], v[:, :, -16:])}
        kernels.quantized(q, k_q, v_q, 0.1, None, 64, 4, n_blocks=n_blocks, **pools)
    return texts


def test_kernel_variants_differ_whenever_input_dtypes_do():
    """mx.fast caches a kernel by name and template arguments only: two calls whose
    inputs differ in any dtype (mask, K/V, scales) must differ in those too."""
    seen: dict[tuple, tuple] = {}

    def make_kernel(name, input_names, output_names, src):
        def kernel(*, inputs, template, output_shapes, output_dtypes, **_):
            key = (name, tuple((k, str(v)) for k, v in template))
            dtypes = tuple(x.dtype for x in inputs)
            assert seen.setdefault(key, dtypes) == dtypes, f"{name}: one variant, two input sets"
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return kernel

    kernels = launch.DecodeKernels("cuda", make_kernel)
    q, k, v, m = make_inputs(64, 64, 3, mask="additive")
    for mask_dtype, kv_dtype in itertools.product([mx.float32, mx.float16], repeat=2):
        kk, vv = k.astype(kv_dtype), v.astype(kv_dtype)
        kernels.dense(q, kk, vv, 0.1, m.astype(mask_dtype))
        kernels.quantized(q, quantize(kk, 64, 8), quantize(vv, 64, 8), 0.1, m.astype(mask_dtype))
    assert len(seen) == 8  # dense and quantized x 2 mask dtypes x 2 K/V (scale) dtypes


@pytest.mark.skipif(emulator.compiler() is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize("dialect", ["metal", "cuda"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_generated_kernels_parse(dialect, dtype, tmp_path):
    stubs = METAL_STUBS if dialect == "metal" else CUDA_STUBS
    for path, text in stubs.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    texts = recorded_kernel_texts(dialect, dtype)
    # dense, quantized, KVarN with and without a front pool, quantized with pools: single
    # pass; two passes (+ the merge each)
    assert len(texts) == 15
    for i, text in enumerate(texts):
        source = tmp_path / f"kernel{i}.cpp"
        source.write_text(text)
        std = "-std=c++14" if dialect == "metal" else "-std=c++17"
        cmd = [
            emulator.compiler(),
            std,
            "-fsyntax-only",
            "-pedantic-errors",
            "-Wno-attributes",
            "-I",
            str(tmp_path),
        ]
        done = subprocess.run([*cmd, str(source)], capture_output=True, text=True)
        assert done.returncode == 0, f"{dialect} kernel {i}:\n{done.stderr[-3000:]}\n{text}"
