"""What the server chooses for a user without being told is said, never silent.

A model without a stated context, a policy whose sliding-window layers hold another
policy's cache, a forced kernel backend that hands calls to the reference, a spill file
that cannot be used, a tokenizer that fails (a server fault, not a client's 400), and
which device counts as the CPU.
"""

from __future__ import annotations

import asyncio
import logging

import mlx.core as mx
import pytest
from jinja2 import TemplateError
from tool_plans import PROMPTED

import kernels.dispatch as dispatch
import models.shape
from cache.budget import ModelShape
from config.cache_spec import CacheSpec
from server.api.errors import APIError
from server.engine.engine import startup_notices

SHAPE = ModelShape(layers=18, kv_heads=1, head_dim=256, element_bytes=4, context=32768)
GEMMA_WINDOWS = [512] * 5 + [None] + [512] * 5 + [None] + [512] * 5 + [None]


def test_an_assumed_context_is_a_notice():
    assumed = ModelShape(30, 3, 64, 4, 4096, context_stated=False)
    [notice] = startup_notices(assumed, CacheSpec("h2o", 256), [None] * 30)
    assert "assuming 4096" in notice and "--context" in notice
    assert startup_notices(SHAPE, CacheSpec("h2o", 256), [None] * 18) == []


@pytest.mark.parametrize(
    ("policy", "serving"), [("h2o-ada", "h2o"), ("h2o-merge", "h2o"), ("h2o-kvarn", "rotating")]
)
def test_sliding_layers_holding_another_policy_is_a_notice(policy, serving):
    [notice] = startup_notices(SHAPE, CacheSpec(policy, 256), GEMMA_WINDOWS)
    assert "15 of 18 layers" in notice and f"keep {serving} caches" in notice
    # its own cache inside the window, or the window fits max_kv: nothing to say
    assert startup_notices(SHAPE, CacheSpec("h2o", 256), GEMMA_WINDOWS) == []
    assert startup_notices(SHAPE, CacheSpec(policy, 1024), GEMMA_WINDOWS) == []


def test_a_forced_backend_says_once_what_it_hands_to_the_reference(monkeypatch, caplog):
    never = dispatch.Backend(
        lambda: True,
        lambda *a, **k: False,
        *(lambda *a, **k: None,) * 2,
        *(lambda *a, **k: False, lambda *a, **k: None) * 3,
    )
    monkeypatch.setitem(dispatch._BACKENDS, "metal", never)
    monkeypatch.setattr(dispatch, "_is_available", lambda name: name in ("metal", "reference"))
    monkeypatch.setattr(dispatch, "_told", set())
    q, k = mx.zeros((1, 4, 1, 64)), mx.zeros((1, 2, 8, 64))
    with caplog.at_level(logging.WARNING, logger="h2o_server.kernels"):
        for _ in range(3):
            assert dispatch.select_backend("metal", q, k) == "reference"
        assert dispatch.select_backend(dispatch.AUTO, q, k) == "reference"  # auto: the plan
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "metal does not take decode attention" in lines[0]


def test_an_unusable_spill_file_of_another_server_is_logged_once(tmp_path, caplog):
    from server.sessions.spill import SpillFolder

    folder = SpillFolder(tmp_path, "me", budget=2**30, max_files=8)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="h2o_server.spill"):
        for _ in range(2):
            gone, found = folder.changes(set())
            assert found == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "broken.safetensors skipped" in lines[0]
    folder.close()


class _Tokenizer:
    chat_template = None  # no tools section

    def __init__(self, error: Exception):
        self.error = error

    def apply_chat_template(self, messages, add_generation_prompt: bool, tools=None):
        raise self.error


class _Engine:
    model_id = "m"
    tool_format = PROMPTED  # a template without tools

    def __init__(self, error: Exception):
        self.tokenizer = _Tokenizer(error)

    def model_names(self):
        return {"m"}


@pytest.mark.parametrize(
    ("error", "status"),
    [(TemplateError("roles must alternate"), 400), (RuntimeError("tokenizer broke"), 500)],
)
def test_a_template_rejection_is_the_clients_error_a_tokenizer_fault_is_ours(error, status):
    from server.api.chat.protocol import ChatCompletionRequest
    from server.api.chat.turn import chat_turn
    from server.api.turns import prepare

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(APIError) as caught:
        asyncio.run(prepare(_Engine(error), chat_turn(body, None, "")))
    assert caught.value.status == status


def test_only_mlx_cpu_device_counts_as_the_cpu(monkeypatch):
    """A CUDA (or Metal) device is not the CPU: weights keep their dtype there and K/V
    are priced at it."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not models.shape.on_cpu()
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert models.shape.on_cpu()


def test_kv_elements_are_priced_at_the_weights_dtype():
    from tiny import tiny

    model = tiny("llama")
    assert models.shape.element_bytes(model) == 4
    model.set_dtype(mx.float16)
    assert models.shape.element_bytes(model) == 2
    assert models.shape.kv_shape(model).element_bytes == 2
