"""The model catalog's names (server/engine/catalog.py) and the registry's idle rules
(server/engine/registry.py), without loading a model: a models file's aliases, ttl and
pin, and the errors a bad file gets."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from config.settings import ServerSettings
from server.engine.catalog import catalog, file_models
from server.engine.registry import Loaded, ModelRegistry

MODELS_FILE = """
[coder]
source = "/models/Qwen3-Coder"
aliases = ["claude-sonnet-4-5", "gpt-5-codex"]
ttl = "2s"

[small]
source = "gemma3-270m"
pin = true
draft_model = false
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return str(path)


def test_a_models_file_names_models_with_aliases_ttl_and_pin(tmp_path):
    settings = ServerSettings(model="default", models_file=write(tmp_path, MODELS_FILE))
    entries = {e.name: e for e in catalog(settings)}
    assert list(entries) == ["SmolLM2-135M-Instruct", "coder", "small"]
    coder = entries["coder"]
    assert coder.source == "/models/Qwen3-Coder" and coder.ttl == 2.0 and not coder.pin
    assert {"claude-sonnet-4-5", "gpt-5-codex", "coder"} <= coder.aliases
    assert entries["small"].pin and entries["small"].ttl is None


def test_a_models_files_draft_model_is_that_models_own(tmp_path):
    """A table's draft_model replaces --draft-model for its model (false: none); a model
    without one keeps the server's."""
    text = MODELS_FILE + '\n[paired]\nsource = "/models/Qwen3-8B"\ndraft_model = "/models/q06"\n'
    settings = ServerSettings(
        model="default", models_file=write(tmp_path, text), draft_model="/models/any"
    )
    registry = ModelRegistry(settings, load_engine=None)
    drafts = {e.name: registry.model_settings(e).draft_model for e in catalog(settings)}
    assert drafts == {
        "SmolLM2-135M-Instruct": "/models/any",
        "coder": "/models/any",
        "small": None,
        "paired": "/models/q06",
    }


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[a]\naliases = ['b']\n", "needs source"),
        ("[a]\nsource = 'x'\nttl = 'soon'\n", "ttl is seconds or a duration"),
        ("[a]\nsource = 'x'\npinned = true\n", "unknown keys ['pinned']"),
        ("[a]\nsource = 'x'\naliases = 'b'\n", "aliases is a list"),
        ("[a]\nsource = 'x'\ndraft_model = true\n", "draft_model is a source"),
        ("[a\nsource = 'x'\n", "--models-file"),
    ],
)
def test_a_bad_models_file_is_refused_with_what_is_wrong(tmp_path, text, says):
    with pytest.raises(ValueError) as e:
        file_models(Path(write(tmp_path, text)))
    assert says in str(e.value)


class FakeModel:
    """Something to weakref."""


class FakeEngine:
    """What unloading touches: a model to weakref, a store to spill and close; and what
    the memory budget counts."""

    weight_bytes = kv_budget = 2**20

    def __init__(self):
        self.model = FakeModel()
        self.store = SimpleNamespace(spill_all=lambda: 0, close=lambda: None, counts=Counter())


def test_a_models_files_ttl_and_pin_decide_when_an_idle_model_unloads(tmp_path):
    settings = ServerSettings(
        model="default", models_file=write(tmp_path, MODELS_FILE), model_ttl=3600
    )
    registry = ModelRegistry(settings, load_engine=None)
    long_ago = time.monotonic() - 10
    for name in ("SmolLM2-135M-Instruct", "coder", "small"):
        registry.loaded[name] = Loaded(FakeEngine(), None, long_ago)
    registry.tick(busy=())
    # coder's own 2 s ttl has run out, the default's --model-ttl (an hour) has not, and
    # small is pinned.
    assert set(registry.loaded) == {"SmolLM2-135M-Instruct", "small"}
    assert registry.pinned("small") and not registry.pinned("coder")


def test_a_default_model_over_the_memory_budget_alone_is_not_unloaded_for_it(tmp_path):
    """It loaded anyway (the server has nothing else to serve): idling does not unload it."""
    settings = ServerSettings(model="default", memory_budget="1MiB", kv_budget="1MiB")
    registry = ModelRegistry(settings, load_engine=None)
    registry.loaded["SmolLM2-135M-Instruct"] = Loaded(FakeEngine(), None, time.monotonic() - 10)
    assert registry.over_budget()
    registry.tick(busy=())
    assert set(registry.loaded) == {"SmolLM2-135M-Instruct"}
