"""A tiny --kv-budget with more conversations than fit: spill, restore, drop."""

from __future__ import annotations

import pytest
from server_harness import MODEL, largest_layer, running_server

BUDGET = 8 * 2**20  # two sessions of ~89 tokens each (46.8 kB per token on CPU)


def turn(api, key, history, text, max_tokens=12):
    history.append({"role": "user", "content": text})
    r = api.client.chat.completions.create(
        model=MODEL,
        messages=history,
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"prompt_cache_key": key},
    )
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


@pytest.fixture(scope="module")
def spilling(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budget")
    flags = ["--kv-budget", str(BUDGET), "--max-sessions", "2", "--spill-dir", str(tmp / "spill")]
    flags += ["--policy", "h2o"]  # dense: `auto` would pick 8-bit at this budget
    with running_server(tmp, *flags) as api:
        yield api, tmp / "spill"


def test_old_sessions_spill_and_resume(spilling):
    api, spill_dir = spilling
    histories = {k: [] for k in ("c1", "c2", "c3", "c4")}
    for k, h in histories.items():
        turn(api, k, h, f"My code word is {k.upper()}-77. Please say hello to me.")
    sessions = api.sessions()
    resident = [s for s in sessions.values() if not s["spilled"]]
    assert len(resident) <= 2
    assert sessions["c1"]["spilled"] and sessions["c2"]["spilled"]
    assert sorted(p.stem for p in spill_dir.glob("*.safetensors")) == ["c1", "c2"]
    m = api.metrics()
    assert m["h2o_sessions_spilled_total"] >= 2
    assert m["h2o_cache_bytes"] <= BUDGET
    assert all(s["max_kv"] < 100 and s["stored_tokens"] <= largest_layer(s) for s in resident)

    # the newest conversation is correct: same reply as a cold run of its history
    newest = turn(api, "c4", histories["c4"], "What is my code word?")
    cold = api.client.chat.completions.create(
        model=MODEL, messages=histories["c4"][:-1], temperature=0, max_tokens=12,
        extra_body={"prompt_cache_key": "c4-cold"},
    )  # fmt: skip
    assert newest.usage.prompt_tokens_details.cached_tokens > 0
    assert newest.choices[0].message.content == cold.choices[0].message.content

    # a spilled conversation comes back from disk with its cache
    resumed = turn(api, "c1", histories["c1"], "What is my code word?")
    assert resumed.usage.prompt_tokens_details.cached_tokens > 0
    assert api.metrics()["h2o_sessions_restored_total"] >= 1
    assert not api.sessions()["c1"]["spilled"]


def test_without_spill_dir_old_sessions_are_dropped(tmp_path):
    flags = ["--kv-budget", str(BUDGET), "--max-sessions", "1", "--api-key", "s3cret"]
    flags += ["--policy", "h2o"]
    with running_server(tmp_path, *flags) as api:
        wrong = {"Authorization": "Bearer nope"}
        denied = api.post("/v1/chat/completions", {"model": MODEL, "messages": []}, wrong)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert api.get("/health").status_code == 200  # probes need no key
        a, b = [], []
        turn(api, "a", a, "Hello, I am A.")
        turn(api, "b", b, "Hello, I am B.")
        assert "a" not in api.sessions()
        assert api.metrics()["h2o_sessions_dropped_total"] == 1
        again = turn(api, "a", a, "Who am I?")  # rebuilt from the history the client sends
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].message.content


def test_auto_under_a_small_budget_bounds_every_session(tmp_path):
    """`auto` with a share too small for the whole context picks an evicting policy:
    a conversation longer than its max_kv keeps going, within its share."""
    with running_server(tmp_path, "--kv-budget", str(BUDGET), "--max-sessions", "2") as api:
        history = [{"role": "user", "content": "Tell me about goats. " * 120}]  # ~640 tokens
        r = api.client.chat.completions.create(
            model=MODEL, messages=history, temperature=0, max_tokens=8,
            extra_body={"prompt_cache_key": "long"},
        )  # fmt: skip
        assert r.usage.prompt_tokens > 600 and r.choices[0].message.content
        s = api.sessions()["long"]
        assert s["policy"] == "h2o-q8"  # what `auto` bounds a conversation with
        # longer than even the largest layer of the profile (457 of 639 here): every
        # layer evicts
        assert s["stored_tokens"] <= largest_layer(s) < s["logical_tokens"]
        assert s["evictions"] > 0 and s["bytes"] <= BUDGET // 2


def test_auto_packs_a_conversation_once_it_outgrows_its_dense_share(tmp_path):
    """`auto` where a share holds the whole context only packed (kvarn): a conversation
    starts in plain dense caches and is packed when it would outgrow what its share holds
    dense (256 tokens here), in decode as in prefill, and goes on from its cache."""
    flags = ["--kv-budget", "48MiB", "--max-sessions", "2", "--context", "2048"]
    with running_server(tmp_path, *flags) as api:

        def ask(history, max_tokens, key="goats"):
            return api.client.chat.completions.create(
                model=MODEL, messages=history, temperature=0, max_tokens=max_tokens,
                logit_bias={"2": -100},  # no <|im_end|>: the reply runs to max_tokens
                extra_body={"prompt_cache_key": key},
            )  # fmt: skip

        def kinds(key="goats") -> set[str]:
            return {h["kind"] for h in api.get(f"/v1/sessions/{key}/cache").json()["heads"]}

        history = [{"role": "user", "content": "Tell me about goats. " * 30}]
        r = ask(history, 8)
        s = api.sessions()["goats"]
        assert s["policy"] == "kvarn" and s["dense_until"] == 256
        assert s["logical_tokens"] < 256 and kinds() == {"full"}
        # the reply takes the conversation past 256 tokens: packed between two decode steps
        history.append({"role": "assistant", "content": r.choices[0].message.content})
        history.append({"role": "user", "content": "And sheep?"})
        r = ask(history, 100)
        assert r.usage.prompt_tokens < 256 < r.usage.prompt_tokens + 100
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        packed = api.sessions()["goats"]
        assert kinds() == {"kvarn"} and packed["logical_tokens"] > 256
        assert packed["bytes"] < packed["logical_tokens"] * s["bytes"] / s["logical_tokens"]
        assert "packed at" in api.log_text()
        # the next turn goes on from the packed cache
        history.append({"role": "assistant", "content": r.choices[0].message.content})
        history.append({"role": "user", "content": "Which of them is smaller?"})
        r = ask(history, 8)
        assert r.usage.prompt_tokens_details.cached_tokens > 256 and r.choices[0].message.content
        assert kinds() == {"kvarn"}
        # a prompt longer than the dense share is packed before its first chunk
        r = ask([{"role": "user", "content": "Tell me about cows. " * 60}], 8, key="cows")
        assert r.usage.prompt_tokens > 256 and kinds("cows") == {"kvarn"}
