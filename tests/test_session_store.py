"""SessionStore without a model: lookup, rewind, rebuild, memory bounds, spill and restore.

"Layers" are real mlx-lm / H2O caches fed small arrays; `feed` plays the worker's part
(what the caches hold must equal `session.tokens`).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny import tiny

from cache import make_cache
from config.cache_spec import CacheSpec
from server.engine.jobs import PromptTooLong, SessionBusy
from server.sessions.store import SessionStore, common_prefix

FULL = CacheSpec("full", 512)
H2O = CacheSpec("h2o", 16)


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture
def store_for(model, tmp_path):
    def build(max_sessions: int = 4, spill: bool = False) -> SessionStore:
        spill_dir = tmp_path / "spill" if spill else None
        return SessionStore(lambda spec: make_cache(model, spec), max_sessions, spill_dir)

    return build


def ids(store) -> set[str]:
    return {s.id for s in store.sessions.values()}


def feed(model, session, tokens: list[int]) -> None:
    """What the worker does after acquire: run the new tokens through the caches."""
    new = tokens[len(session.tokens) :]
    mx.eval(model(mx.array([new]), cache=session.caches))
    session.tokens.extend(new)


def turn(store, model, key, prompt, spec=FULL):
    session, reused = store.acquire(key, prompt, spec)
    feed(model, session, prompt)
    store.release(session)
    return session, reused


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_keyed_session_reuses_its_history_and_leaves_the_last_token(store_for, model):
    store = store_for()
    s, reused = turn(store, model, "chat", [1, 2, 3, 4])
    assert reused == 0 and s.tokens == [1, 2, 3, 4]
    s2, reused = store.acquire("chat", [1, 2, 3, 4, 5, 6], FULL)
    assert s2 is s and reused == 4
    store.release(s2)
    # the same prompt again: the last token is prefilled anew, its logits start the reply
    s3, reused = store.acquire("chat", [1, 2, 3, 4], FULL)
    assert reused == 3 and s3.tokens == [1, 2, 3] and s3.caches[0].offset == 3
    store.release(s3)


def test_an_edited_history_rewinds_to_the_last_matching_token(store_for, model):
    store = store_for()
    turn(store, model, "chat", [1, 2, 3, 4, 5, 6])
    s, reused = store.acquire("chat", [1, 2, 9, 9], FULL)
    assert reused == 2 and s.tokens == [1, 2] and all(c.offset == 2 for c in s.caches)


def test_a_rewind_across_an_eviction_rebuilds(store_for, model):
    store = store_for()
    s, _ = turn(store, model, "chat", list(range(1, 30)), H2O)  # 29 tokens, max_kv 16
    assert s.caches[0].evicted > 0
    s, reused = store.acquire("chat", [1, 2, 3], H2O)
    assert reused == 0 and s.tokens == [] and s.caches[0].offset == 0
    assert store.counts["rebuilt"] == 1


def test_a_prompt_with_too_much_to_prefill_leaves_the_session_untouched(store_for, model):
    store = store_for()
    prompt = list(range(1, 30))  # 29 tokens, max_kv 16: evicted, an early edit cannot rewind
    s, _ = turn(store, model, "chat", prompt, H2O)
    held, seen = list(s.tokens), s.caches[0].seen
    with pytest.raises(PromptTooLong) as e:
        store.acquire("chat", [1, 2, *range(50, 80)], H2O, max_new=20)
    assert e.value.new_tokens == 32
    assert s.tokens == held and s.caches[0].seen == seen and not s.busy  # not rebuilt
    assert store.counts["rebuilt"] == 0
    # its next turn still reuses the cache
    s2, reused = store.acquire("chat", [*prompt, 30, 31], H2O, max_new=20)
    assert s2 is s and reused == len(prompt)
    store.release(s2)
    # a new conversation refused leaves no session behind
    with pytest.raises(PromptTooLong):
        store.acquire("other", list(range(1, 40)), H2O, max_new=20)
    assert ids(store) == {"chat"}


def test_an_edit_inside_the_held_window_after_eviction_trims(store_for, model):
    """The recent window is held in order after evictions: an edit there rewinds."""
    store = store_for()
    prompt = list(range(1, 30))  # 29 tokens, max_kv 16 (recent window 4)
    s, _ = turn(store, model, "chat", prompt, H2O)
    assert s.caches[0].evicted > 0
    edited = prompt[:-2] + [99, 98]  # the last two tokens re-rendered
    s, reused = store.acquire("chat", edited, H2O)
    assert reused == 27 and s.tokens == prompt[:27]
    assert all(c.offset == 27 for c in s.caches) and store.counts["rebuilt"] == 0


def test_anonymous_sessions_are_found_by_a_prompt_that_extends_them(store_for, model):
    store = store_for()
    a, _ = turn(store, model, None, [7, 7, 1, 2])
    b, _ = turn(store, model, None, [7, 7, 3, 4])  # same system prompt, another chat
    assert a.id != b.id
    found, reused = store.acquire(None, [7, 7, 1, 2, 5], FULL)
    assert found is a and reused == 4
    store.release(found)
    other, reused = store.acquire(None, [7, 7], FULL)  # extends no stored prompt: a new one
    assert other not in (a, b) and reused == 0


def test_a_busy_keyed_session_makes_the_next_turn_wait(store_for, model):
    store = store_for()
    s, _ = store.acquire("chat", [1, 2], FULL)
    with pytest.raises(SessionBusy):
        store.acquire("chat", [1, 2, 3], FULL)
    with pytest.raises(SessionBusy):
        store.delete("chat")
    store.release(s)
    assert store.delete("chat") and ids(store) == set()


def test_a_failed_request_leaves_no_session(store_for, model):
    store = store_for()
    turn(store, model, "chat", [1, 2, 3])
    s, _ = store.acquire("chat", [1, 2, 3, 4], FULL)
    store.release(s, broken=True)
    assert ids(store) == set() and store.snapshot() == []


def test_a_session_that_cannot_be_prepared_is_not_kept(model, tmp_path):
    def unbuildable(spec):
        raise RuntimeError("no memory")

    store = SessionStore(unbuildable, 2)
    with pytest.raises(RuntimeError):
        store.acquire("chat", [1, 2, 3], FULL)
    with pytest.raises(RuntimeError):
        store.acquire(None, [1, 2, 3], FULL)
    assert ids(store) == set() and store.snapshot() == []


def test_owners_see_only_their_own_sessions(store_for, model):
    store = store_for()
    mine, _ = turn(store, model, "chat", [1, 2, 3])
    other, reused = store.acquire("chat", [1, 2, 3, 4], FULL, owner="someone")
    assert other is not mine and reused == 0  # same key, another caller: another session
    store.release(other)
    anon, reused = store.acquire(None, [1, 2, 3, 4], FULL, owner="someone")
    assert anon is not mine and reused == 0  # a prefix of another caller's is not reused
    store.release(anon)
    assert not store.delete("chat", owner="nobody")
    assert store.delete("chat", owner="someone") and store.delete("chat")


def test_least_recently_used_idle_sessions_are_dropped_without_a_spill_dir(store_for, model):
    store = store_for(max_sessions=2)
    for key in ("a", "b", "c"):
        turn(store, model, key, [1, 2, 3])
    assert ids(store) == {"b", "c"} and store.counts["dropped"] == 1


def test_spilled_sessions_come_back_with_their_cache(store_for, model):
    store = store_for(max_sessions=1, spill=True)
    a, _ = turn(store, model, "a", [1, 2, 3, 4], H2O)
    turn(store, model, "b", [5, 6], H2O)
    assert a.caches is None and a.spill_path.exists()
    stats = {s["id"]: s for s in store.snapshot()}
    assert stats["a"]["spilled"] and stats["a"]["stored_tokens"] == 0
    assert stats["a"]["logical_tokens"] == 4
    a2, reused = store.acquire("a", [1, 2, 3, 4, 8], H2O)
    assert a2 is a and reused == 4 and a.caches[0].offset == 4
    assert store.counts["spilled"] == 2 and store.counts["restored"] == 1
    store.release(a2)
    stats = {s["id"]: s for s in store.snapshot()}
    assert stats["a"]["stored_tokens"] == 4 and stats["a"]["bytes"] > 0


def test_another_spec_rebuilds_the_session(store_for, model):
    store = store_for()
    turn(store, model, "chat", [1, 2, 3])
    s, reused = store.acquire("chat", [1, 2, 3, 4], H2O)
    assert reused == 0 and s.spec == H2O and s.caches[0].max_size == 16
