"""OpenBLAS must be loaded before MLX on Linux: a 40x matmul difference on CPU."""

import sys

import pytest

from config import blas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
def test_openblas_loaded_before_mlx():
    if blas._find_openblas() is None:
        pytest.skip("no OpenBLAS on this machine (make setup installs libopenblas0-pthread)")
    assert blas.loaded_path is not None
    assert blas.preload_openblas() == blas.loaded_path  # idempotent
