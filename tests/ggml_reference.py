"""An independent reference dequantizer for GGUF tensor types, for the tests.

Written from the C reference functions in llama.cpp's ggml-quants.c
(`dequantize_row_*`, `get_scale_min_k4`) and kept in their shape: the same
byte offsets, the same loops over sub-blocks, vectorized only across blocks.
It shares no code with the loader's paths (MLX's C++ reader, gguf-py's numpy
dequantizers), so agreement means both decode the bytes as llama.cpp does.

Also a plain Q5_K quantizer (per 32-element sub-block min/scale, 6-bit scale
codes), because gguf-py has none and no installed file carries Q5_K: it turns
real float weights into valid Q5_K blocks for the loader tests.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
# type name -> (elements per block, bytes per block)
BLOCKS = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}  # fmt: skip


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian float16 at byte `at` of every block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _u32(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 4].copy().view("<u4").astype(np.uint32)


def _q4_0(b):
    d = _f16(b, 0)
    qs = b[:, 2:18].astype(np.int32)
    return np.concatenate([(qs & 0x0F) - 8, (qs >> 4) - 8], axis=1) * d


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    qs = b[:, 4:20].astype(np.int32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1) * d + m


def _q5_high_bits(qh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    j = np.arange(16, dtype=np.uint32)
    xh_0 = ((qh >> j) << 4) & 0x10  # bit j -> 5th bit of element j
    xh_1 = (qh >> (j + 12)) & 0x10  # bit j + 16 -> 5th bit of element j + 16
    return xh_0.astype(np.int32), xh_1.astype(np.int32)


def _q5_0(b):
    d = _f16(b, 0)
    xh_0, xh_1 = _q5_high_bits(_u32(b, 2))
    qs = b[:, 6:22].astype(np.int32)
    return np.concatenate([((qs & 0x0F) | xh_0) - 16, ((qs >> 4) | xh_1) - 16], axis=1) * d


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    xh_0, xh_1 = _q5_high_bits(_u32(b, 4))
    qs = b[:, 8:24].astype(np.int32)
    return np.concatenate([(qs & 0x0F) | xh_0, (qs >> 4) | xh_1], axis=1) * d + m


def _q8_0(b):
    return b[:, 2:34].copy().view(np.int8).astype(np.float32) * _f16(b, 0)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: the 6-bit scale and min codes of sub-block j."""
    q = q.astype(np.int32)
    if j < 4:
        return q[:, j] & 63, q[:, j + 4] & 63
    d = (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
    m = (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)
    return d, m


def _k_quant(b: np.ndarray, high_bits: bool) -> np.ndarray:
    """Q4_K (no high bits) and Q5_K: d, dmin, 12 scale bytes, [qh 32], qs 128."""
    d, dmin = _f16(b, 0)[:, 0], _f16(b, 2)[:, 0]
    scales = b[:, 4:16]
    qh = b[:, 16:48].astype(np.int32) if high_bits else None
    qs = b[:, 48:176] if high_bits else b[:, 16:144]
    out = np.empty((b.shape[0], QK_K), np.float32)
    for n, j in enumerate(range(0, QK_K, 64)):
        ql = qs[:, n * 32 : n * 32 + 32].astype(np.int32)
        u1, u2 = 1 << (2 * n), 2 << (2 * n)
        for half, (lo, u) in enumerate(((ql & 0xF, u1), (ql >> 4, u2))):
            sc, m = _scale_min_k4(2 * n + half, scales)
            q = lo + (np.where(qh & u, 16, 0) if high_bits else 0)
            d1, m1 = (d * sc)[:, None], (dmin * m)[:, None]
            out[:, j + 32 * half : j + 32 * half + 32] = d1 * q - m1
    return out


def _q6_k(b):
    ql_all, qh_all = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc_all = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    out = np.empty((b.shape[0], QK_K), np.float32)
    for n in range(2):  # two halves of 128 elements
        ql, qh, sc = ql_all[:, 64 * n :], qh_all[:, 32 * n :], sc_all[:, 8 * n :]
        for i in range(32):  # ggml's `l`
            is_ = i // 16
            q1 = ((ql[:, i] & 0xF) | (((qh[:, i] >> 0) & 3) << 4)) - 32
            q2 = ((ql[:, i + 32] & 0xF) | (((qh[:, i] >> 2) & 3) << 4)) - 32
            q3 = ((ql[:, i] >> 4) | (((qh[:, i] >> 4) & 3) << 4)) - 32
            q4 = ((ql[:, i + 32] >> 4) | (((qh[:, i] >> 6) & 3) << 4)) - 32
            y = out[:, 128 * n :]
            y[:, i] = d[:, 0] * sc[:, is_] * q1
            y[:, i + 32] = d[:, 0] * sc[:, is_ + 2] * q2
            y[:, i + 64] = d[:, 0] * sc[:, is_ + 4] * q3
            y[:, i + 96] = d[:, 0] * sc[:, is_ + 6] * q4
    return out


_DEQUANT = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": lambda b: _k_quant(b, False), "Q5_K": lambda b: _k_quant(b, True), "Q6_K": _q6_k,
}  # fmt: skip


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of a tensor of `shape` (numpy order) stored as `raw` bytes."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if type_name == "F32":
        return raw.view(np.float32).reshape(shape)
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if type_name == "BF16":  # the top 16 bits of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    _, size = BLOCKS[type_name]
    return _DEQUANT[type_name](raw.reshape(-1, size)).reshape(shape)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Plain Q5_K blocks [n_blocks, 176] for float32 `x` (size a multiple of 256).

    Per 32-element sub-block: min m <= 0 and scale s = (max - m) / 31, stored as
    6-bit codes of the block's d = max(s) / 63 and dmin = max(-m) / 63 (not
    llama.cpp's iterative search: valid blocks, less accurate).
    """
    sub = x.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - lo) / 31
    d = np.maximum(scale.max(axis=1), 1e-12) / 63
    dmin = np.maximum(-lo.min(axis=1), 1e-12) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.ceil(scale / d16.astype(np.float32)[:, None]), 1, 63).astype(np.int32)
    mn = np.clip(np.round(-lo / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.int32)
    step = (d16.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin16.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round((sub + offset) / step), 0, 31).astype(np.int32)  # [n, 8, 32]

    n = sub.shape[0]
    out = np.zeros((n, 176), np.uint8)
    out[:, 0:2] = d16.reshape(n, 1).view(np.uint8)
    out[:, 2:4] = dmin16.reshape(n, 1).view(np.uint8)
    packed = np.zeros((n, 12), np.int32)  # inverse of get_scale_min_k4
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    out[:, 4:16] = packed
    qh = np.zeros((n, 32), np.int32)
    for pair in range(4):  # sub-blocks 2p (low nibbles) and 2p+1 (high nibbles)
        low, high = q[:, 2 * pair], q[:, 2 * pair + 1]
        out[:, 48 + 32 * pair : 80 + 32 * pair] = (low & 0xF) | ((high & 0xF) << 4)
        qh |= ((low >> 4) & 1) << (2 * pair) | ((high >> 4) & 1) << (2 * pair + 1)
    out[:, 16:48] = qh
    return out
