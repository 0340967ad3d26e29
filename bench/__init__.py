"""Evaluation and benchmarks, run as entry points (`python -m bench.<name>`, `h2o-server eval`).

Every module here is a script or serves one, so this package's first act is the
OpenBLAS preload that any entry point makes before MLX is imported (config/blas.py).
"""

from config.blas import preload_openblas

preload_openblas()
