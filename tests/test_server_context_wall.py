"""A chat longer than the context window keeps going under h2o (RoPE positions re-indexed).

The server runs with `--context 256` so that a chat can reach 3x its context
in a few turns on this CPU; the default model's own context is 8192.
"""

from __future__ import annotations

import pytest
from server_harness import MODEL, largest_layer, running_server

CONTEXT, MAX_KV = 256, 64
FACTS = [
    "The lighthouse on the northern cape was built from grey granite in the spring.",
    "Its keeper kept a logbook of every ship that passed the rocks at night.",
    "In winter the lamp burned whale oil, and later it burned paraffin.",
    "A storm once broke three of the windows, and the keeper repaired them himself.",
]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("context-wall")
    flags = ["--context", str(CONTEXT), "--policy", "h2o", "--kv-budget", "64MiB"]
    with running_server(tmp, *flags, "--max-sessions", "2") as s:
        yield s


def test_a_chat_three_times_the_context_keeps_going(api):
    """Ten turns of ~75 prompt tokens (prefilled) and 12 reply tokens (decoded, the slow
    part on this CPU): the last turn's history is past 3x the context (938 tokens)."""
    history, cached = [], []
    for turn in range(10):
        text = " ".join(FACTS[(turn + i) % len(FACTS)] for i in range(4))
        history.append({"role": "user", "content": f"Part {turn + 1}. {text} Go on."})
        r = api.client.chat.completions.create(
            model=MODEL,
            messages=history,
            temperature=0,
            max_tokens=12,
            extra_body={"prompt_cache_key": "wall", "kv_cache": {"max_kv": MAX_KV}},
        )
        reply = r.choices[0].message.content
        assert reply.strip(), f"turn {turn + 1}: empty reply"
        history.append({"role": "assistant", "content": reply})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert r.usage.prompt_tokens > 3 * CONTEXT  # the whole history, sent every turn
    assert all(c > 0 for c in cached[1:]), cached  # each turn prefilled only what was new
    session = api.sessions()["wall"]
    assert session["logical_tokens"] > 3 * CONTEXT
    assert session["max_kv"] == MAX_KV
    assert session["stored_tokens"] <= largest_layer(session) + 1  # bounded memory all along
    assert api.metrics()["h2o_cache_bytes"] <= 64 * 2**20


def test_one_request_still_prefills_at_most_the_context(api):
    long = [{"role": "user", "content": "word " * (CONTEXT + 50)}]
    for policy in ("h2o", "full"):
        r = api.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": long, "max_tokens": 2, "kv_cache": {"policy": policy}},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert str(CONTEXT) in error["message"]
    assert not any(s["logical_tokens"] == 0 for s in api.sessions().values())  # no phantom
