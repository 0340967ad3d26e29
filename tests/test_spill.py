"""The spill folder across restarts, without a model server: index, restore, refuse, bound.

"Restart" is a second SessionStore on the same folder (the first one closed), as a
new server process would build it.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from tiny import tiny

from cache import make_cache
from config.cache_spec import CacheSpec
from server.sessions.claims import PARTIAL
from server.sessions.spill import model_identity
from server.sessions.store import SessionStore

FULL = CacheSpec("full", 512)
H2O = CacheSpec("h2o", 64)
ROTATING = CacheSpec("rotating", 64)
PROMPT = list(range(1, 41))


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture
def open_store(model, tmp_path):
    opened = []

    def build(identity=None, budget=2**40, max_sessions=2) -> SessionStore:
        store = SessionStore(
            lambda spec: make_cache(model, spec),
            max_sessions,
            tmp_path / "spill",
            model_identity=identity or model_identity(model),
            spill_budget=budget,
        )
        opened.append(store)
        return store

    yield build
    for store in opened:
        store.close()


def turn(store, model, key, prompt, spec=H2O, owner=""):
    session, reused = store.acquire(key, prompt, spec, owner)
    logits = model(mx.array([prompt[reused:]]), cache=session.caches)[0, -1]
    session.tokens.extend(prompt[reused:])
    store.release(session)
    mx.eval(logits)
    return session, reused, logits


def files(store):
    return sorted(p.name for p in store.spill.path.glob("*.safetensors"))


@pytest.mark.parametrize("spec", [FULL, H2O], ids=["full", "h2o"])
def test_a_spill_writes_only_the_tokens_held(open_store, model, spec):
    store = open_store()
    session, _, _ = turn(store, model, "chat", PROMPT, spec)
    held, layers = sum(c.nbytes for c in session.caches), len(session.caches)
    store.spill_all()
    size = session.spill_path.stat().st_size
    per_token = layers * 2 * (2 * 8 * 4 + 8)  # 2 KV heads: K and V (8 float32) + H2O's 8 bytes
    assert size < len(PROMPT) * per_token + 8192, (size, held)  # + header and small arrays
    if spec is FULL:
        assert size < held / 3  # 40 of 256 allocated slots


@pytest.mark.parametrize("spec", [FULL, ROTATING, H2O], ids=["full", "rotating", "h2o"])
def test_sessions_survive_a_restart_with_their_caches(open_store, model, spec):
    first = open_store()
    turn(first, model, "a", PROMPT, spec)
    turn(first, model, None, PROMPT[:20], owner="u1")
    assert first.spill_all() == 2
    first.close()

    second = open_store()
    stats = {s["id"]: s for s in second.snapshot()}
    assert stats["a"]["spilled"] and stats["a"]["logical_tokens"] == len(PROMPT)
    longer = PROMPT + [7, 8, 9]
    session, reused, logits = turn(second, model, "a", longer, spec)
    assert reused == len(PROMPT) and second.counts["restored"] == 1
    cold = make_cache(model, spec)
    expected = model(mx.array([longer]), cache=cold)[0, -1]
    assert mx.allclose(logits, expected, atol=1e-4)
    anon, reused, _ = turn(second, model, None, PROMPT[:20] + [5], owner="u1")
    assert reused == 20 and anon.owner == "u1"
    assert files(second) == []  # restored sessions leave the disk


def test_unusable_files_are_refused_with_a_log_line_and_removed(
    open_store, model, tmp_path, caplog
):
    first = open_store()
    for key in ("keep", "cut"):
        turn(first, model, key, PROMPT)
    first.spill_all()
    first.close()
    folder = first.spill.path
    cut = folder / "cut.safetensors"
    cut.write_bytes(cut.read_bytes()[:-100])  # a write that a crash cut short
    other = SessionStore(
        lambda spec: make_cache(model, spec), 2, tmp_path / "other", model_identity="another"
    )
    turn(other, model, "alien", PROMPT)
    other.spill_all()
    other.close()
    (tmp_path / "other" / "alien.safetensors").rename(folder / "alien.safetensors")
    (folder / PARTIAL / "half.safetensors").write_bytes(b"\0" * 64)
    (folder / "notes.txt").write_text("the user's own file")

    with caplog.at_level(logging.WARNING, logger="h2o_server.spill"):
        store = open_store()
    log = caplog.text
    assert "cut.safetensors refused: truncated" in log
    assert "alien.safetensors refused: made by another model" in log
    assert "cut short by a crash" in log
    assert files(store) == ["keep.safetensors"]
    assert {s["id"] for s in store.snapshot()} == {"keep"}
    assert (folder / "notes.txt").exists()  # not ours: left alone
    assert not (folder / PARTIAL / "half.safetensors").exists()


def test_a_corrupt_file_found_on_restore_rebuilds_the_session(open_store, model):
    store = open_store(max_sessions=1)
    turn(store, model, "a", PROMPT)
    turn(store, model, "b", PROMPT)  # spills a
    path = store.spill.file_for("", "a")
    path.write_text("not a safetensors file")  # damaged while the server ran
    session, reused, _ = turn(store, model, "a", PROMPT + [3])
    assert reused == 0 and store.counts["refused"] == 1
    assert {s["id"] for s in store.snapshot()} == {"a", "b"} and not path.exists()


def test_the_disk_budget_counts_every_file_in_the_folder(open_store, model, tmp_path):
    store = open_store(max_sessions=1)
    turn(store, model, "a", PROMPT)
    turn(store, model, "b", PROMPT)
    size = store.spill.file_for("", "a").stat().st_size
    store.close()
    (tmp_path / "spill" / "big.bin").write_bytes(b"\0" * size)  # someone else's file
    small = open_store(budget=int(size * 1.5), max_sessions=1)
    assert {s["id"] for s in small.snapshot()} == set()  # a no longer fits beside big.bin
    assert files(small) == [] and small.counts["dropped"] == 1
