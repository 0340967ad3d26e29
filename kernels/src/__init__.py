"""Kernel sources: every body is written once and assembled for Metal and for CUDA.

A body (`*.body`) is dialect-neutral text. It uses only:
- the macros and helpers of a dialect header (`dialect_<dialect>.h`): warp sum, shared
  memory, barrier, exp, max, -inf, casts, function qualifiers;
- the thread coordinates declared by a dialect prologue (`prologue_<dialect>.inc`):
  tid, lane, warp, group_y, group_z, n_groups_z;
- dialect-neutral helpers in `common.h` (flat offsets, in-register dequantization);
- compile-time switches given as `#define` lines (QUANTIZED, SPLIT, PASS).

The prologue goes into the function body, not the header, because
`mx.fast.metal_kernel` adds a thread attribute to the signature only when the body's
text names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC_DIR = Path(__file__).parent
DIALECTS = ("metal", "cuda")  # the GPU backends
EMULATOR_DIALECT = "host"  # CPU emulation of the same bodies, for tests (emulator.py)
BODIES = ("decode_attention", "combine_blocks", "decode_weights", "prompt_weights")


@dataclass(frozen=True)
class KernelSource:
    """What `mx.fast.metal_kernel` / `mx.fast.cuda_kernel` take as `header` and `source`."""

    header: str
    source: str


@cache
def read(name: str) -> str:
    return (SRC_DIR / name).read_text()


def assemble(body: str, dialect: str, defines: dict[str, int] | None = None) -> KernelSource:
    """Header and function body of kernel `body` in `dialect` ("metal", "cuda" or "host")."""
    if dialect not in (*DIALECTS, EMULATOR_DIALECT):
        raise ValueError(f"unknown dialect {dialect!r}; known: {DIALECTS + (EMULATOR_DIALECT,)}")
    if body not in BODIES:
        raise ValueError(f"unknown kernel body {body!r}; known: {BODIES}")
    header = read(f"dialect_{dialect}.h") + "\n" + read("common.h")
    switches = "".join(f"#define {name} {value}\n" for name, value in (defines or {}).items())
    source = switches + read(f"prologue_{dialect}.inc") + read(f"{body}.body")
    return KernelSource(header=header, source=source)
