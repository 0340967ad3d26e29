"""Shared system prompts: a new conversation forks a stored prefix instead of prefilling it.

One real server, sessions scoped to callers. Alice's second chat forks the system prompt
her first chat stored; Bob, another caller, must prefill it himself (owners never share a
prefix by default), which gives the reference a fork must equal: the same greedy reply,
and under h2o the same held positions per head after the prefix's own eviction.
"""

from __future__ import annotations

import pytest
from server_harness import MODEL, running_server

pytestmark = pytest.mark.slow(seconds=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--session-scope", "caller", "--max-sessions", "4", "--kv-budget", "512MiB"]
    with running_server(tmp_path_factory.mktemp("prefix"), *flags) as api:
        yield api


@pytest.fixture(scope="module")
def system(essay_text) -> str:
    """About 450 tokens of instructions: over --prefix-min-tokens (256)."""
    return "Answer questions about this essay.\n\n" + essay_text[:2000]


def chat(api, user: str, key: str, system: str, question: str, kv_cache: dict) -> dict:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 12,
        "temperature": 0,
        "user": user,
        "prompt_cache_key": key,
        "kv_cache": kv_cache,
    }
    r = api.request("POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def held(api, user: str, key: str) -> list[str]:
    r = api.request("GET", f"/v1/sessions/{key}/cache?user={user}")
    assert r.status_code == 200, r.text
    return [h["bitmap"] for h in r.json()["heads"]]


def metric(api, name: str) -> float:
    text = api.request("GET", "/metrics").body.decode()
    line = next(x for x in text.splitlines() if x.startswith(f"h2o_{name} "))
    return float(line.split()[1])


@pytest.mark.parametrize(
    "kv_cache",
    [{"policy": "full", "max_kv": 1024}, {"policy": "h2o", "max_kv": 128}],
    ids=["full", "h2o"],
)
def test_a_second_chat_forks_the_system_prompt_and_replies_as_if_it_prefilled_it(
    server, system, kv_cache
):
    policy = kv_cache["policy"]
    hits = metric(server, "sessions_prefix_hits_total")
    first = chat(server, "alice", f"a1-{policy}", system, "Who wrote it?", kv_cache)
    assert cached(first) == 0
    forked = chat(server, "alice", f"a2-{policy}", system, "What is it about?", kv_cache)
    alone = chat(server, "bob", f"b1-{policy}", system, "What is it about?", kv_cache)
    assert cached(forked) > 256, forked["usage"]  # the system prompt came from the store
    assert cached(alone) == 0, "another caller forked alice's system prompt"
    assert forked["choices"][0]["message"] == alone["choices"][0]["message"]
    assert held(server, "alice", f"a2-{policy}") == held(server, "bob", f"b1-{policy}")
    assert metric(server, "sessions_prefix_hits_total") == hits + 1
    assert metric(server, "sessions_prefix_tokens_total") >= cached(forked)
    view = server.request("GET", f"/v1/sessions/a2-{policy}/cache?user=alice").json()
    assert view["prefix_tokens"] == cached(forked)
    store = view["prefix_store"]
    assert store["entries"] >= 1 and 0 < store["bytes"] <= store["capacity"]
    assert store["hits"] == metric(server, "sessions_prefix_hits_total")
    if policy == "h2o":  # the prefix itself was evicted into: the fork took those evictions
        assert view["evictions"] > 0


def test_the_store_stays_within_its_share(server):
    stored = metric(server, "prefix_store_bytes")
    share = 0.125 * 512 * 2**20  # --prefix-share of --kv-budget
    assert 0 < stored <= share
    assert metric(server, "cache_budget_bytes") == pytest.approx(512 * 2**20, rel=1e-5)


def test_a_short_system_prompt_is_not_stored(server):
    entries = metric(server, "prefix_store_entries")
    for key in ("s1", "s2"):
        reply = chat(server, "carol", key, "Be brief.", "Hello?", {"policy": "full"})
        assert cached(reply) == 0
    assert metric(server, "prefix_store_entries") == entries
