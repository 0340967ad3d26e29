"""The OpenAI contract where peers' API tests and client libraries found holes: finite
logprobs under a grammar, exact completion text, chat logprobs of the content, n > 1,
batched prompts, tool-call streams, tools beside response_format, strict JSON.

Every body and stream event here is read with a strict JSON parser (no NaN, no
Infinity), as browsers and most parsers read them.
"""

from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest
from server_harness import MODEL

pytestmark = pytest.mark.slow(seconds=90)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {  # open: no additionalProperties, as most clients send it
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}
EIFFEL = [{"role": "user", "content": "Where is the Eiffel tower? Give the city."}]
HI = [{"role": "user", "content": "Say hi"}]


def _refuse(constant: str):
    raise ValueError(f"not JSON: {constant}")


def strict(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are errors."""
    return json.loads(text, parse_constant=_refuse)


def post(api, path: str, body: dict) -> tuple[int, dict]:
    r = api.post(path, body)
    return r.status_code, strict(r.text)


def stream(api, path: str, body: dict) -> list[dict]:
    """Every event of a stream, strictly parsed, up to [DONE] (which must come)."""
    conn = api.connection()
    try:
        conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        assert r.status == 200, r.read()
        events = []
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    return events
                events.append(strict(data))
        raise AssertionError("the stream ended without [DONE]")
    finally:
        conn.close()


# ---------------------------------------------------------------------- logprobs


def _check_masked(content: list[dict]) -> None:
    for entry in content:
        tops = entry["top_logprobs"]
        assert 1 <= len(tops) <= 5
        assert all(math.isfinite(t["logprob"]) and t["logprob"] <= 0 for t in tops)
        assert math.isfinite(entry["logprob"]) and entry["token"] == tops[0]["token"]  # greedy
    # where the grammar allows one token only ('{"', the key), one alternative is left
    assert any(len(e["top_logprobs"]) < 5 for e in content)


def test_logprobs_under_a_grammar_are_finite_and_of_allowed_tokens(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    body = dict(
        model=MODEL,
        messages=EIFFEL,
        max_tokens=30,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        response_format=fmt,
    )
    status, reply = post(api, "/v1/chat/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY)
    _check_masked(choice["logprobs"]["content"])
    events = stream(api, "/v1/chat/completions", body)
    streamed = [
        e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]
    ]
    assert streamed == choice["logprobs"]["content"]


def test_completion_text_is_exactly_its_tokens(api):
    body = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    status, reply = post(api, "/v1/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "".join(logprobs["tokens"])
    assert choice["text"].startswith(" ")  # " Paris": the space is the reply's
    assert logprobs["text_offset"] == [
        len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))
    ]
    events = stream(api, "/v1/completions", body)
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]


def test_echo_with_logprobs_gives_the_prompts_tokens_too(api):
    prompt = "The meaning of life is"
    body = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=1, echo=True)
    status, reply = post(api, "/v1/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
    assert "".join(logprobs["tokens"]) == choice["text"]
    n_prompt = reply["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == n_prompt + reply["usage"]["completion_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert logprobs["text_offset"][n_prompt] == len(prompt)
    # Streamed: the echo, then its tokens' logprobs, then the reply, the same text.
    events = stream(api, "/v1/completions", body)
    texts = [c["text"] for e in events for c in e["choices"]]
    tokens = [
        t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]
    ]
    assert "".join(texts) == choice["text"] and tokens == logprobs["tokens"]


def test_chat_logprobs_cover_the_content_not_the_stop_token(api):
    r = api.client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=60, temperature=0, logprobs=True
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content


# ---------------------------------------------------------------------- requests


def test_stream_options_without_stream_is_a_400(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=4, stream_options={"include_usage": True}
        )
    assert e.value.body["param"] == "stream_options"


def test_models_retrieve(api):
    assert api.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        api.client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_n_greedy_choices_are_identical_and_the_prompt_counts_once(api):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=12, temperature=0)
    one = api.client.chat.completions.create(**kwargs)
    three = api.client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_seeded_choices_are_each_reproducible_streamed_or_not(api):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=12, temperature=1.0, seed=11)
    a = api.client.chat.completions.create(**kwargs, n=3)
    b = api.client.chat.completions.create(**kwargs, n=3)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # each choice draws its own tokens
    one = api.client.chat.completions.create(**kwargs)
    assert one.choices[0].message.content == texts[0]  # choice 0 is the n = 1 reply
    streamed = {}
    for chunk in api.client.chat.completions.create(**kwargs, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_a_list_of_prompts_gives_a_choice_each_in_order(api):
    prompts = ["One, two,", "A, B,", "Red, green,"]
    kwargs = dict(model=MODEL, max_tokens=5, temperature=0)
    alone = [api.client.completions.create(**kwargs, prompt=p).choices[0].text for p in prompts]
    batch = api.client.completions.create(**kwargs, prompt=prompts)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == alone
    ids = api.client.completions.create(**kwargs, prompt=[[504, 3575], [504, 3575]], n=2)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    assert len({c.text for c in ids.choices}) == 1  # greedy: four times the same


def test_best_of_and_too_many_choices_are_400s(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(model=MODEL, prompt="x", best_of=2, max_tokens=2)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        api.client.chat.completions.create(model=MODEL, messages=HI, n=9, max_tokens=2)
    assert e.value.body["param"] == "n"


# ---------------------------------------------------------------------- tools


def test_a_forced_call_streams_one_entry_per_index_in_each_chunk(api):
    body = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
    )
    events = stream(api, "/v1/chat/completions", body)
    entries = [c["delta"].get("tool_calls") or [] for e in events for c in e["choices"]]
    assert all(len({d["index"] for d in e}) == len(e) for e in entries)
    heads = [d for e in entries for d in e if "id" in d]
    assert [h["function"]["name"] for h in heads] == ["get_weather"]
    arguments = "".join(d["function"].get("arguments", "") for e in entries for d in e)
    assert json.loads(arguments)["city"]


def test_a_forced_call_cut_by_max_tokens_is_still_a_call(api):
    body = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=14,
        temperature=0,
    )
    status, reply = post(api, "/v1/chat/completions", body)
    choice = reply["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"].startswith('{"city"')  # cut inside its arguments
    events = stream(api, "/v1/chat/completions", body)
    deltas = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls") or []]
    assert (
        "".join(d["function"].get("arguments", "") for d in deltas)
        == (call["function"]["arguments"])
    )
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == [
        "length"
    ]


def test_open_schemas_get_no_made_up_keys(api):
    """A small model copied schema words in as keys of open objects until max_tokens."""
    for city in ["Oslo", "Lima", "Cairo", "Perth", "Quito"]:
        r = api.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Weather in {city}?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
        )
        (call,) = r.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city"}
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_tools_beside_response_format(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    kwargs = dict(model=MODEL, tools=[WEATHER], response_format=fmt, max_tokens=60, temperature=0)
    asked = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced = api.client.chat.completions.create(**kwargs, messages=asked, tool_choice="required")
    (call,) = forced.choices[0].message.tool_calls  # a forced choice: the call first
    history = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny in Oslo."},
    ]
    for messages in (asked, history):  # auto: calls, or the schema's JSON
        message = api.client.chat.completions.create(**kwargs, messages=messages).choices[0].message
        if message.tool_calls:
            assert [c.function.name for c in message.tool_calls] == ["get_weather"]
        else:
            jsonschema.validate(json.loads(message.content), CITY)


def test_every_reply_and_event_is_strict_json(api):
    """The cases above and more, whole and streamed, read by a strict parser."""
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    cases = [
        (
            "/v1/chat/completions",
            dict(messages=EIFFEL, response_format=fmt, logprobs=True, top_logprobs=20),
        ),
        (
            "/v1/chat/completions",
            dict(
                messages=HI,
                logprobs=True,
                top_logprobs=3,
                n=2,
                temperature=1.0,
                logit_bias={"28": -100},
            ),
        ),
        (
            "/v1/chat/completions",
            dict(
                messages=EIFFEL,
                tools=[WEATHER],
                tool_choice="required",
                logprobs=True,
                top_logprobs=20,
            ),
        ),
        ("/v1/completions", dict(prompt=["Hello,", "Bye,"], echo=True, logprobs=5)),
    ]
    for path, body in cases:
        body = {"model": MODEL, "max_tokens": 12, "temperature": 0, **body}
        status, _ = post(api, path, body)
        assert status == 200
        assert stream(api, path, {**body, "stream_options": {"include_usage": True}})
