"""GET /v1/sessions/{id}/cache on the real server: shape, agreement with /v1/sessions,
every policy, errors, and the API key."""

from __future__ import annotations

import base64
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from server_harness import MODEL, largest_layer

LAYERS, KV_HEADS = 30, 3  # the default model
# About 200 tokens of user text: several evictions at max_kv 64.
LONG = " ".join(f"Item {i} of the list is a {c} box." for i, c in enumerate(["red", "blue"] * 12))
POLICIES = {  # policy -> max_kv (full must fit the whole conversation)
    "full": 512,
    "rotating": 64,
    "h2o": 64,
    "h2o-merge": 64,
    "h2o-recall": 64,
    "h2o-q8": 64,
    "h2o-q4": 64,
    "h2o-mixed": 64,
    "kvarn": 512,  # keeps every token, like full
    "h2o-kvarn": 64,
}
KEEP_ALL = ("full", "kvarn")


def chat(api, key: str, policy: str, max_kv: int, content: str = LONG, max_tokens: int = 8):
    return api.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"prompt_cache_key": key, "kv_cache": {"policy": policy, "max_kv": max_kv}},
    )


def assert_reply_is_last(report: dict, reply) -> None:
    """The conversation's last tokens are the reply's (an end-of-turn token included)."""
    reply_text = "".join(report["tokens"]["text"][-reply.usage.completion_tokens :])
    assert reply_text.startswith(reply.choices[0].message.content)


def held_bits(head: dict, n: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(head["bitmap"]), np.uint8)
    assert len(raw) == (n + 7) // 8
    return np.unpackbits(raw, bitorder="little").astype(bool)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_report_agrees_with_sessions(api, policy):
    key = f"cv-{policy}-{uuid.uuid4().hex[:6]}"
    reply = chat(api, key, policy, POLICIES[policy])
    r = api.get(f"/v1/sessions/{key}/cache")
    assert r.status_code == 200
    report, session = r.json(), api.sessions()[key]
    assert report["object"] == "session.cache"
    assert {k: report[k] for k in session} == session  # the same figures, same names
    n, stored = session["logical_tokens"], session["stored_tokens"]
    tokens, pairs = report["tokens"], LAYERS * KV_HEADS
    assert (report["layers"], report["kv_heads"], len(report["heads"])) == (LAYERS, KV_HEADS, pairs)
    assert len(tokens["ids"]) == len(tokens["text"]) == len(tokens["held"]) == n
    assert "Item 3 of the list is a blue box." in "".join(tokens["text"])
    assert_reply_is_last(report, reply)

    maps = np.array([held_bits(h, n) for h in report["heads"]])
    assert not maps[:, n:].any()  # padding bits past the last token stay clear
    assert [int(m.sum()) for m in maps] == [h["held"] for h in report["heads"]]
    assert maps.sum(axis=0)[:n].tolist() == tokens["held"]
    assert max(h["held"] for h in report["heads"]) == stored
    assert session["evictions"] == n - stored

    seg = report["segments"]
    assert seg["kind"] == ("h2o" if policy.startswith("h2o") else policy)
    held = np.array(tokens["held"])
    if policy in KEEP_ALL:
        assert stored == n and (held == pairs).all() and seg["recent"] == 0
    else:
        assert stored <= largest_layer(session) < n and (held < pairs).any()  # evicted
        assert (held[: seg["sink"]] == pairs).all() and (held[n - seg["recent"] :] == pairs).all()
    if policy.startswith("h2o"):
        scores = tokens["score"]
        assert all((s is None) == (h == 0) for s, h in zip(scores, held, strict=True))
    else:
        assert tokens["score"] is None

    (turn,) = report["turns"]
    assert turn["usage"]["prompt_tokens"] == reply.usage.prompt_tokens
    assert turn["usage"]["completion_tokens"] == reply.usage.completion_tokens
    assert (turn["logical_tokens"], turn["stored_tokens"]) == (n, stored)


def check_consistent(report: dict) -> None:
    """Tokens, holder counts, bitmaps and figures describe one and the same moment."""
    n, tokens = report["logical_tokens"], report["tokens"]
    assert len(tokens["ids"]) == len(tokens["text"]) == len(tokens["held"]) == n
    maps = np.array([held_bits(h, n) for h in report["heads"]])
    assert not maps[:, n:].any()
    assert maps.sum(axis=0)[:n].tolist() == tokens["held"]
    assert max(h["held"] for h in report["heads"]) == report["stored_tokens"]
    assert report["evictions"] == n - report["stored_tokens"]


# full: prompts are prefilled batched too; kvarn: rows of one padded slab, lent to the view
@pytest.mark.parametrize("policy", ["h2o", "full", "kvarn"])
def test_report_while_sessions_decode_together(api, policy):
    """Sessions answering in one batched decode pass are read between two rounds (32 tokens
    each: reads see both busy within the first few steps)."""
    keys = [f"cv-batch-{policy}-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    both_busy, reads = False, 0
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(chat, api, k, policy, POLICIES[policy], LONG, 32) for k in keys]
        while not all(r.done() for r in replies):
            busy = []
            for key in keys:
                r = api.get(f"/v1/sessions/{key}/cache")
                if r.status_code == 404:  # not admitted yet
                    continue
                report = r.json()
                check_consistent(report)
                busy.append(report["busy"])
                reads += 1
            both_busy |= busy == [True, True]
        finished = [r.result() for r in replies]
    assert reads and both_busy
    for key, reply in zip(keys, finished, strict=True):
        report = api.get(f"/v1/sessions/{key}/cache").json()
        check_consistent(report)
        assert not report["busy"]
        assert_reply_is_last(report, reply)


def test_turns_accumulate_with_reused_tokens(api):
    key = f"cv-turns-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "user", "content": LONG}]
    extra = {"prompt_cache_key": key, "kv_cache": {"policy": "h2o", "max_kv": 64}}
    first = api.client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, extra_body=extra
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Which colour comes first?"},
    ]
    second = api.client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, extra_body=extra
    )
    turns = api.get(f"/v1/sessions/{key}/cache").json()["turns"]
    assert len(turns) == 2
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert turns[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == reused > 0
    assert turns[1]["logical_tokens"] > turns[0]["logical_tokens"]


def test_unknown_and_malformed_sessions(api):
    r = api.get("/v1/sessions/no-such-session/cache")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = api.get("/v1/sessions/bad$id/cache")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"


def test_the_key_is_required(keyed_api):
    key = f"cv-auth-{uuid.uuid4().hex[:6]}"
    chat(keyed_api, key, "h2o", 64, "Hello!", max_tokens=4)
    path = f"/v1/sessions/{key}/cache"
    for auth in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        r = keyed_api.request("GET", path, headers=auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert keyed_api.get(path).status_code == 200
