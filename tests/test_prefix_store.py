"""The prefix store without a server: forks, least-recently-used eviction, its byte bound.

Real caches of a tiny llama; `prefill` plays the worker's part (server/engine/generation.py
breaks the prefill at the prefix and hands the session to `keep_prefix` there).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny import tiny

from cache import make_cache
from config.cache_spec import CacheSpec
from server.api.shared_prefix import system_prefix_len
from server.sessions.prefixes import PrefixStore
from server.sessions.store import SessionStore

FULL = CacheSpec("full", 512)
H2O = CacheSpec("h2o", 32)
SYSTEM = [3 + i * 7 % 50 for i in range(80)]  # an 80-token "system prompt" (vocab: 64)


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def store_with(model, capacity: int, shared: bool = False) -> SessionStore:
    return SessionStore(
        lambda spec: make_cache(model, spec), 4, prefixes=PrefixStore(capacity, shared)
    )


def prefill(model, store, session, prompt: list[int], prefix_len: int) -> mx.array:
    """Feed the prompt but its last token, breaking at the prefix; the last token's logits."""
    for end in (prefix_len, len(prompt) - 1):
        new = prompt[len(session.tokens) : end]
        if new:
            mx.eval(model(mx.array([new]), cache=session.caches))
            session.tokens.extend(new)
            if len(session.tokens) == prefix_len:
                store.keep_prefix(session)
    return model(mx.array([prompt[-1:]]), cache=session.caches)[0, -1]


def chat(model, store, prompt, spec, owner=""):
    session, reused = store.acquire(None, prompt, spec, owner)
    logits = prefill(model, store, session, prompt, len(SYSTEM))
    store.release(session)
    return session, reused, logits


@pytest.mark.parametrize("spec", [FULL, H2O], ids=["full", "h2o"])
def test_a_fork_continues_as_its_own_prefill_would(model, spec):
    store = store_with(model, 2**30)
    chat(model, store, SYSTEM + [55, 56, 57], spec)
    session, reused, forked = chat(model, store, SYSTEM + [60, 61], spec)
    assert reused == len(SYSTEM) and session.prefix_tokens == len(SYSTEM)
    alone = store_with(model, 2**30)
    _, reused_alone, reference = chat(model, alone, SYSTEM + [60, 61], spec)
    assert reused_alone == 0
    assert mx.allclose(forked, reference, atol=1e-5).item()
    # and the stored copy is untouched by the fork's own tokens: a third chat forks it too
    _, reused, third = chat(model, store, SYSTEM + [60, 61], spec)
    assert reused == len(SYSTEM) and mx.allclose(third, reference, atol=1e-5).item()


def test_the_least_recently_used_prefix_goes_first_and_the_bound_holds(model):
    one = store_with(model, 2**30)
    chat(model, one, SYSTEM + [55, 56], FULL)
    entry_bytes = one.prefixes.nbytes
    store = store_with(model, int(1.5 * entry_bytes))  # room for one entry
    other = [t + 1 for t in SYSTEM]
    chat(model, store, SYSTEM + [55, 56], FULL)
    chat(model, store, other + [55, 56], FULL)
    assert store.prefixes.nbytes <= store.prefixes.capacity
    assert [len(e.tokens) for e in store.prefixes.entries] == [len(SYSTEM)]
    _, reused, _ = chat(model, store, SYSTEM + [58, 59], FULL)  # its prefix was dropped
    assert reused == 0  # a plain prefill, which stores it again
    _, reused, _ = chat(model, store, SYSTEM + [60, 59], FULL)
    assert reused == len(SYSTEM)
    assert store.prefixes.nbytes <= store.prefixes.capacity


def test_a_prefix_bigger_than_the_store_is_not_kept(model):
    store = store_with(model, 1024)
    chat(model, store, SYSTEM + [55, 56], FULL)
    assert store.prefixes.entries == []


def test_owners_share_prefixes_only_when_told(model):
    private = store_with(model, 2**30)
    chat(model, private, SYSTEM + [55, 56], FULL, owner="alice")
    assert chat(model, private, SYSTEM + [57, 56], FULL, owner="bob")[1] == 0
    assert chat(model, private, SYSTEM + [58, 56], FULL, owner="alice")[1] == len(SYSTEM)
    shared = store_with(model, 2**30, shared=True)
    chat(model, shared, SYSTEM + [55, 56], FULL, owner="alice")
    assert chat(model, shared, SYSTEM + [57, 56], FULL, owner="bob")[1] == len(SYSTEM)


def test_another_spec_does_not_fork(model):
    store = store_with(model, 2**30)
    chat(model, store, SYSTEM + [55, 56], FULL)
    assert chat(model, store, SYSTEM + [57, 56], H2O)[1] == 0


def test_the_prefix_is_the_leading_system_messages():
    def render(messages):  # a template: each message is its role's id, then its words
        return [t for m in messages for t in [1 if m["role"] == "system" else 2, *m["content"]]]

    messages = [
        {"role": "system", "content": list(range(10, 310))},
        {"role": "user", "content": [7]},
    ]
    prompt = render(messages) + [3]  # the generation prompt
    assert system_prefix_len(render, messages, prompt, 256) == 301
    assert system_prefix_len(render, messages, prompt, 302) == 0  # under the minimum
    assert system_prefix_len(render, messages[:1], render(messages[:1]), 1) == 0  # no question
    assert system_prefix_len(render, messages[1:], prompt, 1) == 0  # no system message

    def rejects(messages):
        raise ValueError("this template wants a user turn")

    assert system_prefix_len(rejects, messages, prompt, 1) == 0
