"""Hadamard rotation along the head dim: orthonormal, symmetric, its own inverse.

Rotating queries and keys alike leaves q.k unchanged; attention over rotated values
gives the rotated output, turned back by one more product with the same matrix. The
rotation spreads each outlier channel's energy over the whole head dim, so one
quantization scale no longer has to span a few huge channels.

A power-of-two head dim gets the Sylvester matrix H_D / sqrt(D). Any other even head
dim gets a block-diagonal one: Sylvester blocks of the largest power of two dividing
D (96 -> three blocks of 32, 80 -> five of 16), still exactly orthonormal but mixing
channels only inside a block. An odd head dim has no Hadamard block: ValueError.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np


def hadamard_block(head_dim: int) -> int:
    """Size of the Hadamard blocks for `head_dim`: its largest power-of-two divisor."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(
            f"head dim {head_dim} cannot be Hadamard-rotated: it needs an even head dim "
            "(a power of two, or blocks of its largest power-of-two divisor)"
        )
    return head_dim & -head_dim


@cache
def _matrix(head_dim: int) -> np.ndarray:
    block = hadamard_block(head_dim)
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(block)
    return np.kron(np.eye(head_dim // block), h)


@cache
def rotation_matrix(head_dim: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The [D, D] rotation R (R == R.T, R @ R == I) for `head_dim`."""
    return mx.array(_matrix(head_dim), dtype=dtype)


def rotate(x: mx.array) -> mx.array:
    """x @ R along the last axis (R is its own inverse: rotate(rotate(x)) == x)."""
    D = x.shape[-1]
    if D & (D - 1) == 0 and mx.default_device() == mx.cpu:
        # One op on the CPU (1.5 us at a decode step's shapes) where the matmul takes three
        # (flatten, matmul, unflatten: 5 us); the same Sylvester R to float rounding.
        return mx.hadamard_transform(x, scale=D**-0.5)
    return x @ rotation_matrix(D, x.dtype)
