"""Conversations across turns: cache reuse, isolation, concurrency and disconnects."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import MODEL

pytestmark = pytest.mark.slow(seconds=55)

FACTS = {
    "a": "My name is Alice and my favourite colour is green.",
    "b": "My name is Bob and I keep three goats on a farm.",
}


def chat(api, messages, key=None, max_tokens=24, **kw):
    kw.setdefault("extra_body", {"prompt_cache_key": key} if key else {})
    return api.client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )


def test_second_turn_reuses_the_first(api):
    key = f"t-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": FACTS["a"] + " Say hello."}]
    first = chat(api, messages, key)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What is my name?"},
    ]
    second = chat(api, messages, key)
    cached = second.usage.prompt_tokens_details.cached_tokens
    turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
    assert turn1 - 3 <= cached < second.usage.prompt_tokens  # minus template slack
    session = api.sessions()[key]
    assert session["logical_tokens"] >= second.usage.prompt_tokens
    # `auto` under a 512 MiB budget for 8 sessions: a bounded cache within the 64 MiB share
    # (KVarN when the whole context fits packed, H2O otherwise)
    assert session["policy"] in ("kvarn", "h2o") and 0 < session["bytes"] <= 64 * 2**20


def test_anonymous_follow_up_is_found_by_prefix(api):
    messages = [{"role": "user", "content": "Remember the number 4812. Reply with OK."}]
    first = chat(api, messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Which number?"},
    ]
    second = chat(api, messages, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_interleaved_conversations_stay_apart(api):
    """A and B alternate turns on their own sessions; each second turn equals a cold run.
    Twelve tokens a reply: the two second turns already tell Alice from Bob."""
    run = uuid.uuid4().hex[:6]
    histories = {n: [{"role": "user", "content": FACTS[n] + " Say hello."}] for n in FACTS}
    for n in FACTS:  # turn 1 of A, then of B
        r = chat(api, histories[n], key=f"{n}-{run}", max_tokens=12)
        histories[n] += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "Tell me what you know about me."},
        ]
    warm = {n: chat(api, histories[n], key=f"{n}-{run}", max_tokens=12) for n in FACTS}
    for n in FACTS:
        assert warm[n].usage.prompt_tokens_details.cached_tokens > 0
        cold = chat(api, histories[n], key=f"cold-{n}-{run}", max_tokens=12)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm[n].choices[0].message.content == cold.choices[0].message.content
    assert warm["a"].choices[0].message.content != warm["b"].choices[0].message.content


def test_eight_concurrent_streams(api):
    """Eight greedy streams decoded together reply what each does alone (8 tokens each:
    the replies fall into the same four distinct texts as with 16)."""
    prompts = [f"Count from {i} to {i + 5}, separated by commas." for i in range(8)]

    def expected(p):
        return chat(api, [{"role": "user", "content": p}], max_tokens=8).choices[0].message.content

    def streamed(p):
        chunks = chat(api, [{"role": "user", "content": p}], max_tokens=8, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    solo = [expected(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(streamed, prompts))
    assert together == solo


def test_disconnect_stops_generation(api):
    before = api.metrics()
    conn = api.connection()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long essay about rivers."}],
        "max_tokens": 4000,
        "temperature": 0,  # greedy: a long reply, never an end-of-sequence first token
        "stream": True,
    }
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    r = conn.getresponse()
    assert r.status == 200
    seen, deadline = b"", time.monotonic() + 300
    while seen.count(b"data:") < 4:  # the role chunk and three more events
        part = r.read1(256)
        assert part, f"the stream ended before it was cut: {seen!r}"  # EOF would spin forever
        assert time.monotonic() < deadline, f"no tokens in 300 s: {seen!r}"
        seen += part
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while True:
        m = api.metrics()
        if m["h2o_requests_cancelled_total"] > before["h2o_requests_cancelled_total"]:
            break
        assert time.monotonic() < deadline, "generation did not stop"
        time.sleep(0.2)
    assert m["h2o_active_generations"] == 0
    assert m["h2o_completion_tokens_total"] - before["h2o_completion_tokens_total"] < 100
    # the server keeps serving
    assert (
        "Paris"
        in chat(api, [{"role": "user", "content": "What is the capital of France?"}])
        .choices[0]
        .message.content
    )


def test_kv_cache_picks_the_kvarn_bits(api):
    key = f"kvarn-{uuid.uuid4().hex[:8]}"
    options = {"policy": "h2o-kvarn", "max_kv": 128, "kvarn": "k4v4"}
    reply = chat(api, [{"role": "user", "content": "Hi"}], max_tokens=4,
                 extra_body={"prompt_cache_key": key, "kv_cache": options})  # fmt: skip
    assert reply.choices[0].message.content
    session = api.sessions()[key]
    assert (session["policy"], session["max_kv"], session["kvarn"]) == ("h2o-kvarn", 128, "k4v4")


def test_delete_session(api):
    key = f"del-{uuid.uuid4().hex[:8]}"
    chat(api, [{"role": "user", "content": "Hi"}], key=key, max_tokens=4)
    assert key in api.sessions()
    assert api.request("DELETE", f"/v1/sessions/{key}").status_code == 200
    assert key not in api.sessions()
    assert api.request("DELETE", f"/v1/sessions/{key}").status_code == 404


def _edited_second_turn(api, key, kv_cache=None):
    """Turn 2 sends turn 1's reply edited (as templates that strip text do); returns
    the warm reply, its usage, and the reply of the same history sent cold (8 greedy tokens
    each, compared whole)."""
    extra = {"kv_cache": kv_cache} if kv_cache else {}
    messages = [{"role": "user", "content": FACTS["b"] + " Tell me about goats in detail."}]
    first = chat(api, messages, max_tokens=24, extra_body={"prompt_cache_key": key, **extra})
    reply = first.choices[0].message.content
    messages += [
        {"role": "assistant", "content": reply[: len(reply) // 2].rstrip()},
        {"role": "user", "content": "How many goats do I have?"},
    ]
    warm = chat(api, messages, max_tokens=8, extra_body={"prompt_cache_key": key, **extra})
    cold_key = key + "-cold"
    cold = chat(api, messages, max_tokens=8, extra_body={"prompt_cache_key": cold_key, **extra})
    return first, warm, cold


def test_reply_rendered_differently_rewinds_the_cache(api):
    first, warm, cold = _edited_second_turn(api, f"edit-{uuid.uuid4().hex[:8]}")
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < first.usage.total_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_rewind_across_an_eviction_rebuilds(api):
    before = api.metrics()["h2o_sessions_rebuilt_total"]
    small = {"policy": "h2o", "max_kv": 32}
    first, warm, cold = _edited_second_turn(api, f"evict-{uuid.uuid4().hex[:8]}", small)
    assert first.usage.total_tokens > 32  # turn 1 evicted
    assert warm.usage.prompt_tokens_details.cached_tokens == 0
    assert api.metrics()["h2o_sessions_rebuilt_total"] == before + 1
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_edited_reply_after_eviction_trims_instead_of_rebuilding(api):
    """Turn 1 evicts (max_kv 64); turn 2 drops the reply's last word, an edit inside the
    recent window every layer still holds: the session is trimmed, not rebuilt.

    Tolerance: the trimmed cache evicted during decoding, a rebuild evicts while
    prefilling, so they hold different middle tokens; the greedy replies must still
    agree on their start (bench/edit_reuse.py measures how far they agree).
    """
    small = {"policy": "h2o", "max_kv": 64}
    key = f"trim-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": FACTS["b"] + " Tell me about goats in detail."}]
    first = chat(
        api, messages, max_tokens=48, extra_body={"prompt_cache_key": key, "kv_cache": small}
    )
    reply = first.choices[0].message.content
    assert first.usage.total_tokens > 64 + 16  # turn 1 evicted
    messages += [
        {"role": "assistant", "content": reply.rsplit(" ", 1)[0]},
        {"role": "user", "content": "How many goats do I have?"},
    ]
    before = api.metrics()["h2o_sessions_rebuilt_total"]
    warm = chat(
        api, messages, max_tokens=16, extra_body={"prompt_cache_key": key, "kv_cache": small}
    )
    cold_key = key + "-cold"
    cold = chat(
        api, messages, max_tokens=16, extra_body={"prompt_cache_key": cold_key, "kv_cache": small}
    )
    assert api.metrics()["h2o_sessions_rebuilt_total"] == before
    assert warm.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm_words = warm.choices[0].message.content.split()
    cold_words = cold.choices[0].message.content.split()
    print("trim vs rebuild:", warm_words, cold_words)
    assert warm_words[:3] == cold_words[:3]
