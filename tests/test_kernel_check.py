"""The start-up kernel check (cache/kernel_check.py): a GPU kernel that disagrees with the
reference, or raises, is withdrawn with a notice, its calls take the reference, and
/health shows the notice.

No GPU here: the GPU backend is `metal` patched in, either the CPU emulation of the
shared Metal/CUDA kernel bodies (the real kernel text) or the reference's own functions
(to break one kind at a time without compiling anything).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from cache import attention
from cache.kernel_check import CASES, check_kernels
from config.settings import ServerSettings
from kernels import dispatch, reference
from kernels.dispatch import Backend
from kernels.src import EMULATOR_DIALECT, emulator, launch
from server.api.app import create_app

REFERENCE = dispatch._BACKENDS["reference"]


def emulated_backend() -> Backend:
    kernels = launch.DecodeKernels(EMULATOR_DIALECT, emulator.make_kernel)
    return Backend(
        lambda: True,
        launch.supports,
        kernels.dense,
        kernels.quantized,
        launch.supports_kvarn,
        kernels.kvarn,
        launch.supports_prompt,
        kernels.prompt_weights,
        launch.supports_decode_weights,
        kernels.decode_weights,
    )


@pytest.fixture
def gpu(monkeypatch):
    """Make `backend` this machine's `metal`; everything is as before once the test ends."""

    def install(backend: Backend) -> None:
        monkeypatch.setitem(dispatch._BACKENDS, "metal", backend)
        monkeypatch.setattr(dispatch, "_is_available", lambda name: name in ("metal", "reference"))
        monkeypatch.setattr(dispatch, "_withdrawn", set())
        monkeypatch.setattr(attention, "_reference_only", lambda: False)

    return install


def _off(fn, by: float = 0.5):
    """`fn` whose first output is shifted: a kernel computing something else."""

    def wrong(*args, **kwargs):
        result = fn(*args, **kwargs)
        if isinstance(result, tuple):
            return (result[0] + by, *result[1:])
        return result + by

    return wrong


def _decode_inputs():
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 4, 1, 64), dtype=np.float32))
    k, v = (mx.array(rng.standard_normal((1, 2, 40, 64), dtype=np.float32)) for _ in range(2))
    return q, k, v


@pytest.mark.skipif(emulator.compiler() is None, reason="the kernel emulation needs a C++ compiler")
def test_the_kernel_bodies_pass_their_own_check(gpu):
    backend = emulated_backend()
    gpu(backend)
    assert all(case(backend) is not None for case in CASES.values())  # every kind was run
    assert check_kernels("auto") == []
    assert dispatch.withdrawn() == set()


def test_reference_only_checks_nothing():
    assert check_kernels("reference") == [] and check_kernels("auto") == []


def test_a_wrong_kernel_is_withdrawn_and_its_calls_take_the_reference(gpu):
    gpu(dataclasses.replace(REFERENCE, dense=_off(reference.sdpa_with_scores)))
    notices = check_kernels("auto")
    assert len(notices) == 1 and "metal kernel for dense calls" in notices[0], notices
    assert "off by up to" in notices[0]
    assert dispatch.withdrawn() == {("metal", "dense")}
    q, k, v = _decode_inputs()
    assert dispatch.select_backend("auto", q, k) == "reference"
    assert dispatch.select_backend("metal", q, k) == "reference"  # forced: still withdrawn
    k_q = mx.quantize(k, group_size=64, bits=8)
    assert dispatch.select_backend("auto", q, k_q[0], group_size=64, bits=8) == "metal"
    out, scores = dispatch.sdpa_with_scores(q, k, v, 0.125)
    want_out, want_scores = reference.sdpa_with_scores(q, k, v, 0.125)
    assert mx.array_equal(out, want_out) and mx.array_equal(scores, want_scores)


def test_a_kernel_that_raises_is_withdrawn(gpu):
    def broken(*args, **kwargs):
        raise RuntimeError("unable to build the kernel\nsecond line")

    gpu(dataclasses.replace(REFERENCE, prompt_weights=broken))
    notices = check_kernels("metal")
    assert len(notices) == 1 and "prompt calls" in notices[0]
    assert "raised RuntimeError: unable to build the kernel" in notices[0]
    assert "second line" not in notices[0]
    assert dispatch.withdrawn() == {("metal", "prompt")}


def test_health_shows_a_withdrawn_kernel(gpu):
    gpu(dataclasses.replace(REFERENCE, decode_weights=_off(reference.decode_weights)))
    app = create_app(ServerSettings(model="default", max_sessions=1), load_engine=None)
    with TestClient(app) as client:
        notices = client.get("/health").json()["notices"]
    withdrawn = [n for n in notices if n.startswith("metal kernel for decode weights")]
    assert len(withdrawn) == 1, notices
    assert dispatch.withdrawn() == {("metal", "decode_weights")}
