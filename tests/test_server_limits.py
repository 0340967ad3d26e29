"""Bounds on what a request may ask: prompt length, seeds, unsupported fields; no leftovers.

Also: /health and /metrics answer while the worker is inside a long prefill.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from server_harness import MODEL

HI = [{"role": "user", "content": "Tell me a story about a cat."}]
CONTEXT = 8192  # SmolLM2-135M-Instruct


def post(api, **fields):
    return api.post("/v1/chat/completions", {"model": MODEL, "messages": HI, **fields})


def test_seeds_are_reduced_modulo_2_64_or_refused(api):
    key = f"seed-{uuid.uuid4().hex[:8]}"
    sample = {"temperature": 1.0, "max_tokens": 12}
    minus_one = post(api, seed=-1, prompt_cache_key=key, **sample)
    assert minus_one.status_code == 200, minus_one.text
    same = post(api, seed=2**64 - 1, **sample)
    assert (
        same.json()["choices"][0]["message"]["content"]
        == (minus_one.json()["choices"][0]["message"]["content"])
    )
    for seed in (2**64, 2**70, -(2**63) - 1):
        r = post(api, seed=seed, prompt_cache_key=f"{key}-{seed}", **sample)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    sessions = api.sessions()
    assert key in sessions and not any(k.startswith(f"{key}-") for k in sessions)


def test_failed_requests_leave_no_phantom_sessions(api):
    key = f"phantom-{uuid.uuid4().hex[:8]}"
    bad = [
        {"seed": 2**64},
        {"n": 9},  # over the most choices a request may ask for
        {"logit_bias": {"99999999": 1}},
        {"kv_cache": {"max_kv": 10**9}},
        {"messages": [{"role": "user", "content": "word " * (CONTEXT + 100)}]},
    ]
    for fields in bad:
        assert post(api, prompt_cache_key=key, max_tokens=2, **fields).status_code == 400
    assert key not in api.sessions()
    assert not any(s["spilled"] for s in api.sessions().values())  # this server has no spill dir
    assert api.metrics()["h2o_sessions_spilled"] == 0


def test_a_prompt_longer_than_the_context_is_refused_naming_both_numbers(api):
    long = [{"role": "user", "content": "word " * (CONTEXT + 100)}]
    for policy in ("h2o", "rotating", "full"):
        r = post(api, messages=long, max_tokens=2, kv_cache={"policy": policy})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert str(CONTEXT) in error["message"]
    tokens = int(error["message"].split("has ")[1].split()[0])
    assert tokens > CONTEXT
    r = api.post("/v1/completions", {"model": MODEL, "prompt": "word " * (CONTEXT + 100)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("response_format", {"type": "xml"}),
        ("tool_choice", "required"),  # without tools
        ("n", 9),  # over MAX_CHOICES
    ],
)
def test_unsupported_fields_are_a_400_naming_them(api, field, value):
    r = post(api, max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(field) and field.split("_")[0] in error["message"]


def test_harmless_values_of_those_fields_are_accepted(api):
    r = post(api, max_tokens=2, response_format={"type": "text"}, tools=[], tool_choice="none")
    assert r.status_code == 200, r.text


def test_health_and_metrics_answer_during_a_long_prefill(api):
    """The worker spends seconds in one prefill; probes must not wait for it."""
    before = api.metrics()["h2o_prefill_tokens_total"]
    # ~1000 tokens: seconds of prefill on 2 cores (~100 probes answered here), far from the
    # client's timeout.
    long = [{"role": "user", "content": "word " * 1000}]
    done, outcome = threading.Event(), []

    def prefill():
        try:
            outcome.append(post(api, messages=long, max_tokens=1, kv_cache={"policy": "h2o"}))
        except Exception as e:  # reported by the main thread
            outcome.append(e)
        finally:
            done.set()  # always: a failed request must end the probing, not hang it

    threading.Thread(target=prefill, daemon=True).start()
    api.wait_for(lambda m: m["h2o_prefill_tokens_total"] > before, what="the prefill to start")
    slowest, answered = 0.0, 0
    deadline = time.monotonic() + 300
    while not done.is_set():
        assert time.monotonic() < deadline, "the prefill did not finish within 300 s"
        start = time.monotonic()
        assert api.get("/health").status_code == 200
        api.metrics()
        slowest = max(slowest, time.monotonic() - start)
        answered += 1
        time.sleep(0.05)
    (reply,) = outcome
    assert not isinstance(reply, Exception) and reply.status_code == 200, reply
    assert answered >= 5 and slowest < 0.5, (answered, slowest)
