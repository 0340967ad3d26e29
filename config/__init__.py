"""Project settings (settings.py), the cache vocabulary (cache_spec.py) and the BLAS preload.

Importing this package has no side effect: entry points call
`config.blas.preload_openblas()` before MLX is imported (see blas.py).
"""
