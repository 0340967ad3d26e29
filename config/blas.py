"""Load the system OpenBLAS before MLX on Linux.

The `mlx[cpu]` wheel links a reference BLAS (~5 GFLOP/s for a 1024^2 float32
matmul on 2 cores); loading OpenBLAS with RTLD_GLOBAL before the first
`import mlx` makes MLX resolve its BLAS symbols there (~190 GFLOP/s, same
results). Set H2O_OPENBLAS to a library path to choose one, or to 0 to skip.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

_CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

loaded_path: str | None = None
SLOW_BLAS_WARNING = (
    "MLX runs on its CPU backend with the reference BLAS its wheel links (~40x slower "
    "float32 matmuls): call config.blas.preload_openblas() before the first `import mlx` "
    "(the h2o-server entry points do), or set H2O_OPENBLAS=0 to silence this"
)


def _find_openblas() -> str | None:
    for pattern in _CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return ctypes.util.find_library("openblas")


def preload_openblas() -> str | None:
    """Load OpenBLAS globally (Linux only); return its path or None."""
    global loaded_path
    if loaded_path is not None or not sys.platform.startswith("linux"):
        return loaded_path
    choice = os.environ.get("H2O_OPENBLAS", "")
    if choice == "0":
        return None
    if "mlx.core" in sys.modules:
        # Too late to take effect: MLX already bound its BLAS symbols.
        return None
    path = choice or _find_openblas()
    if path:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            loaded_path = path
        except OSError:
            loaded_path = None
    return loaded_path


def slow_blas_warning() -> str | None:
    """A warning when MLX on Linux was imported before OpenBLAS could be loaded, else None."""
    if not sys.platform.startswith("linux") or os.environ.get("H2O_OPENBLAS") == "0":
        return None
    if loaded_path is not None or _find_openblas() is None:
        return None
    return SLOW_BLAS_WARNING
