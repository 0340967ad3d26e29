"""Reading a GGUF file: metadata, tensor table, and every tensor as float32.

Tensors are read by the fastest path that is exact for the file's tensor types:

- `mx.load` (MLX's C++ GGUF reader) when every tensor is of a type it loads
  exactly (F32, F16, Q4_0, Q4_1, Q8_0). It is all or nothing per file: MLX 0.32
  refuses Q5_0/Q5_1, turns BF16 and Q6_K into float16 (rounding), and loads Q4_K
  *without error but wrong* (every odd 32-element sub-block), so a file with any
  other type takes the second path.
- the `gguf` package (llama.cpp's gguf-py) dequantizes every other type it
  knows (K-quants, Q5_x, BF16, IQ*) with numpy, from a memory map of the file.

A tensor type neither handles is an error naming the tensor and its type.
Metadata and the tensor table are parsed here rather than with gguf-py's
`GGUFReader`, which spends ~10 s of CPU building per-element fields for a
262k-token vocabulary; this parser reads it in a fraction of a second.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Types mx.load reads exactly (checked per type in tests/test_gguf_types.py).
MLX_EXACT_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
    }
)
# GGUF metadata value types: fixed-size scalars (struct format) ...
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
# ... and the numpy dtype of an array of them; 8 is a string, 9 an array.
_ARRAY_DTYPES = {k: np.dtype(v) for k, v in _SCALARS.items()}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file this loader cannot read correctly."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    ggml_type: int
    offset: int  # absolute, in the file

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"unknown GGML type id {self.ggml_type}"

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return int(np.prod(self.shape)) // block * size


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def types(self) -> set[str]:
        return {t.type_name for t in self.tensors}


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("unexpected end of file in the GGUF header")
    return struct.unpack(fmt, data)[0]


def _read_string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _read_string(f)
    if vtype != _ARRAY:
        raise GGUFError(f"unknown GGUF metadata value type {vtype}")
    item_type, count = _read(f, "<I"), _read(f, "<Q")
    if item_type in _ARRAY_DTYPES:  # numeric arrays in one read
        dtype = _ARRAY_DTYPES[item_type]
        return np.frombuffer(f.read(dtype.itemsize * count), dtype=dtype)
    return [_read_value(f, item_type) for _ in range(count)]


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table (no tensor data is read)."""
    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        metadata = {}
        for _ in range(n_kv):
            key = _read_string(f)
            metadata[key] = _read_value(f, _read(f, "<I"))
        infos = []
        for _ in range(n_tensors):
            name = _read_string(f)
            dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
            infos.append((name, tuple(reversed(dims)), _read(f, "<I"), _read(f, "<Q")))
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-f.tell() // align) * align
    tensors = [TensorInfo(n, s, t, data_start + off) for n, s, t, off in infos]
    return GGUFFile(path, metadata, tensors)


def check_types(file: GGUFFile) -> None:
    """Raise naming every tensor whose type no reader here handles."""
    readable = {q for q in {t.ggml_type for t in file.tensors} if _gguf_py_reads(q)}
    bad = [f"{t.name} ({t.type_name})" for t in file.tensors if t.ggml_type not in readable]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise GGUFError(f"{file.path.name}: tensor types not supported: {shown}")


def _gguf_py_reads(ggml_type: int) -> bool:
    """Whether gguf-py dequantizes this type: tried on one all-zero block."""
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, size = GGML_QUANT_SIZES[qtype]
        gguf_quants.dequantize(np.zeros(size, dtype=np.uint8), qtype)
    except (ValueError, KeyError, NotImplementedError):
        return False
    return True


def load_tensors(file: GGUFFile) -> dict[str, mx.array]:
    """Every tensor of the file, dequantized to float32, keyed by its GGUF name."""
    check_types(file)
    if all(t.ggml_type in MLX_EXACT_TYPES for t in file.tensors):
        return _load_with_mlx(file.path)
    data = np.memmap(file.path, dtype=np.uint8, mode="r")
    return {t.name: dequantize_tensor(data, t) for t in file.tensors}


def dequantize_tensor(data: np.ndarray, info: TensorInfo) -> mx.array:
    """One tensor's bytes (from a uint8 view of the whole file) through gguf-py, as float32."""
    raw = data[info.offset : info.offset + info.nbytes]
    qtype = GGMLQuantizationType(info.ggml_type)
    if qtype == GGMLQuantizationType.F32:
        values = raw.view(np.float32)
    else:
        values = gguf_quants.dequantize(raw, qtype)
    return mx.array(np.asarray(values, dtype=np.float32).reshape(info.shape))


def _load_with_mlx(path: Path) -> dict[str, mx.array]:
    """mx.load, with MLX's packed (weight, scales, biases) triples dequantized exactly.

    Scales and biases are cast to float32 first: MLX keeps them in float16 and
    would otherwise round the dequantized weights to float16.
    """
    loaded = mx.load(str(path))
    out = {}
    for name, w in loaded.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        scales = loaded.get(f"{stem}.scales")
        if scales is not None:
            biases = loaded[f"{stem}.biases"]
            bits, group_size = _packed_layout(w, scales)
            w = mx.dequantize(
                w,
                scales.astype(mx.float32),
                biases.astype(mx.float32),
                group_size=group_size,
                bits=bits,
            )
        out[name] = w.astype(mx.float32)
    return out


def _packed_layout(packed: mx.array, scales: mx.array) -> tuple[int, int]:
    """(bits, group size) of an MLX-packed tensor: GGUF's 32-element blocks, 4 or 8 bits."""
    cols = scales.shape[-1] * 32
    bits, rem = divmod(packed.shape[-1] * 32, cols)
    if rem or bits not in (4, 8):
        raise GGUFError(f"unexpected packed layout {packed.shape} / scales {scales.shape}")
    return bits, 32
