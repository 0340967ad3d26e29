"""Project settings. Importing this package first loads OpenBLAS (see blas.py)."""

from config.blas import preload_openblas

preload_openblas()
