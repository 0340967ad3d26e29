"""Run the shared kernel bodies on the CPU, for tests on machines without a GPU.

`make_kernel` stands in for `mx.fast.metal_kernel` / `mx.fast.cuda_kernel`: it takes the
same (name, inputs, outputs, source) and returns a callable with the same keyword
interface. Plugged into `launch.DecodeKernels("host", make_kernel)`, it drives the very
launch code (grids, template constants, masks, output shapes) and the very body text
that the Metal and CUDA backends compile, with only the dialect header swapped for
`dialect_host.h`. The C++ is compiled once per (source, template) with the system
compiler and cached on disk. Slow by design (one fiber per GPU thread).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels.src import KernelSource

MAX_NDIM = 8
CACHE_DIR = Path(tempfile.gettempdir()) / "h2o_kernel_emulator"

_C_TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("_Float16", np.float16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.int32: ("int32_t", np.int32),
    mx.bool_: ("bool", np.bool_),
}


def compiler() -> str | None:
    """The C++ compiler the emulator uses, or None when there is none."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def make_kernel(
    name: str, input_names: Sequence[str], output_names: Sequence[str], src: KernelSource
) -> Callable:
    """A CPU stand-in for an `mx.fast` custom kernel built from the same source."""
    input_names, output_names = tuple(input_names), tuple(output_names)

    def kernel(
        *,
        inputs: Sequence[mx.array],
        template: Sequence[tuple[str, object]],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        **_: object,
    ) -> list[mx.array]:
        arrays = [np.ascontiguousarray(np.array(x, dtype=_C_TYPES[x.dtype][1])) for x in inputs]
        cpp = _translation_unit(
            src,
            [(n, _C_TYPES[x.dtype][0]) for n, x in zip(input_names, inputs, strict=True)],
            [(n, _C_TYPES[d][0]) for n, d in zip(output_names, output_dtypes, strict=True)],
            template,
        )
        launch = _compile(cpp).launch
        outputs = [
            np.zeros(tuple(s), dtype=_C_TYPES[d][1])
            for s, d in zip(output_shapes, output_dtypes, strict=True)
        ]
        shapes = np.zeros((len(arrays), MAX_NDIM), dtype=np.int32)
        strides = np.zeros((len(arrays), MAX_NDIM), dtype=np.int64)
        for i, a in enumerate(arrays):
            shapes[i, : a.ndim] = a.shape
            strides[i, : a.ndim] = [s // a.itemsize for s in a.strides]
        in_ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        out_ptrs = (ctypes.c_void_p * len(outputs))(*[o.ctypes.data for o in outputs])
        groups = [-(-g // t) for g, t in zip(grid, threadgroup, strict=True)]
        if groups[0] != 1 or threadgroup[1:] != (1, 1):
            raise ValueError("the emulator runs groups along y and z of x-only threadgroups")
        launch(
            in_ptrs,
            shapes.ctypes.data,
            strides.ctypes.data,
            out_ptrs,
            min(threadgroup[0], grid[0]),
            groups[1],
            groups[2],
        )
        return [mx.array(o) for o in outputs]

    return kernel


def _translation_unit(
    src: KernelSource,
    inputs: list[tuple[str, str]],
    outputs: list[tuple[str, str]],
    template: Sequence[tuple[str, object]],
) -> str:
    """The kernel function as MLX would generate it, plus a C entry point."""
    params, args = [], []
    for i, (name, ctype) in enumerate(inputs):
        params += [
            f"const {ctype}* {name}",
            f"const int* {name}_shape",
            f"const int64_t* {name}_strides",
        ]
        args += [
            f"static_cast<const {ctype}*>(in[{i}])",
            f"shapes + {i * MAX_NDIM}",
            f"strides + {i * MAX_NDIM}",
        ]
    for i, (name, ctype) in enumerate(outputs):
        params.append(f"{ctype}* {name}")
        args.append(f"static_cast<{ctype}*>(out[{i}])")
    constants = []
    for name, value in template:
        if isinstance(value, mx.Dtype):
            constants.append(f"  using {name} = {_C_TYPES[value][0]};")
        elif isinstance(value, bool):
            constants.append(f"  constexpr bool {name} = {str(value).lower()};")
        else:
            constants.append(f"  constexpr int {name} = {int(value)};")
    joined_params = ",\n    ".join(params)
    joined_args = ", ".join(args)
    return f"""{src.header}
static void kernel(
    {joined_params}) {{
{chr(10).join(constants)}
{src.source}
}}

extern "C" void launch(void** in, const int* shapes, const int64_t* strides, void** out,
                       int threads, int groups_y, int groups_z) {{
  emu::run(threads, groups_y, groups_z, [&] {{ kernel({joined_args}); }});
}}
"""


@cache
def _compile(cpp: str) -> ctypes.CDLL:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the kernel emulator needs a C++ compiler (c++ or g++)")
    digest = hashlib.sha256((cxx + cpp).encode()).hexdigest()[:20]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    lib = CACHE_DIR / f"{digest}.so"
    if not lib.exists():
        source = CACHE_DIR / f"{digest}.cpp"
        source.write_text(cpp)
        tmp = CACHE_DIR / f"{digest}.{os.getpid()}.so"
        cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(tmp), str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"emulated kernel failed to compile:\n{done.stderr[-4000:]}")
        tmp.replace(lib)  # atomic: concurrent test runs never load a half-written file
    dll = ctypes.CDLL(str(lib))
    dll.launch.restype = None
    dll.launch.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return dll
