"""kernels package."""

import config  # noqa: F401  (loads OpenBLAS before the first mlx import)
