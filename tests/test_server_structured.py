"""Structured outputs and tool calls, through the OpenAI SDK against a real server.

The reply follows the request's JSON schema token by token (llguidance's mask), so a
135M-parameter model's replies parse and validate every time; tool calls come back in
OpenAI's shapes, whole and streamed, and a tool round trip reuses the conversation's cache.
The server is the session's `api` (tests/conftest.py): this file started one with the same
flags (--max-sessions 8, --kv-budget 512MiB) of its own.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from enum import StrEnum
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from server_harness import MODEL

pytestmark = pytest.mark.slow(seconds=60)


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Name(BaseModel):
    name: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)


class Paint(BaseModel):
    color: Color
    glossy: bool


class Tags(BaseModel):
    tags: list[str] = Field(min_length=1, max_length=3)


class Scores(BaseModel):
    scores: list[int] = Field(min_length=2, max_length=4)


class Address(BaseModel):
    street: str = Field(max_length=24)
    number: int = Field(ge=1, le=999)


class Customer(BaseModel):
    name: str = Field(max_length=24)
    address: Address


class Optional_(BaseModel):
    title: str = Field(max_length=24)
    subtitle: str | None = Field(default=None, max_length=24)


class Verdict(BaseModel):
    verdict: Literal["yes", "no", "unsure"]
    reason: str = Field(max_length=40)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Line(BaseModel):
    start: Point
    end: Point


class Step(BaseModel):
    order: int = Field(ge=1, le=9)
    action: str = Field(max_length=24)


class Recipe(BaseModel):
    dish: str = Field(max_length=24)
    steps: list[Step] = Field(min_length=1, max_length=2)


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)


class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)
    unit: Literal["C"]


class Flags(BaseModel):
    urgent: bool
    public: bool
    archived: bool


class Book(BaseModel):
    title: str = Field(max_length=24)
    author: str = Field(max_length=24)
    year: int = Field(ge=1400, le=2030)


class Shelf(BaseModel):
    books: list[Book] = Field(min_length=1, max_length=2)


class Mood(BaseModel):
    mood: Literal["happy", "sad", "calm"]
    intensity: float = Field(ge=0, le=1)


class Contact(BaseModel):
    email: str | None = Field(default=None, max_length=32)
    phone: str | None = Field(default=None, max_length=16)


CASES = [
    (Name, "What is a common English first name?"),
    (Person, "Describe a fictional person with a name and an age."),
    (City, "Tell me about the capital of France."),
    (Paint, "Pick a paint color and finish for a kitchen."),
    (Tags, "Give tags for a blog post about baking bread."),
    (Scores, "Give test scores for two students."),
    (Customer, "Make up a customer with an address."),
    (Optional_, "Give a book title."),
    (Verdict, "Is the sky blue?"),
    (Line, "Describe a line segment on a grid."),
    (Recipe, "How do I make toast?"),
    (Rating, "Rate the movie Casablanca."),
    (Temperature, "What is a warm summer day's temperature?"),
    (Flags, "Classify this ticket: the server is down for all users."),
    (Shelf, "Recommend a classic novel."),
    (Mood, "How does a sunny morning feel?"),
    (Contact, "Give contact details for a support desk."),
    (Paint, "Choose a color for a stop sign."),
    (Person, "Describe an old sailor."),
    (City, "Tell me about Tokyo."),
]


def ask(api, prompt: str, model: type[BaseModel], stream: bool = False):
    messages = [
        {"role": "system", "content": "Reply in JSON."},
        {"role": "user", "content": prompt},
    ]
    kwargs = dict(model=MODEL, messages=messages, temperature=0, max_tokens=160)
    if not stream:
        return api.client.chat.completions.parse(response_format=model, **kwargs)
    with api.client.chat.completions.stream(response_format=model, **kwargs) as s:
        return s.get_final_completion()


def test_twenty_schemas_parse_whole_and_streamed(api):
    """Eight clients at a time, each schema asked for whole and streamed: constrained rows
    decode batched, each with its own matcher."""
    jobs = [(case, stream) for case in CASES for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda job: ask(api, job[0][1], job[0][0], job[1]), jobs))
    for ((model, _), stream), reply in zip(jobs, replies, strict=True):
        choice = reply.choices[0]
        if not stream:
            assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model), (stream, choice.message)


@pytest.mark.parametrize(
    "prompt",
    [
        "Reply with a JSON object with the keys name and age of a cat.",
        "Describe a cat as JSON with a name and a color.",
    ],
)
def test_json_object_replies_parse(api, prompt):
    r = api.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_reply_cut_by_max_tokens_says_length(api):
    r = api.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=3,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def valid_weather(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


def test_required_tool_choice_yields_a_valid_call(api):
    r = api.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert valid_weather(call.function.arguments)


def test_forced_calls_of_sdk_pydantic_tools_with_nested_models_validate(api):
    """openai.pydantic_function_tool keeps nested models in `$defs` (Customer's Address,
    Paint's Color), referred to from the parameters' root: each forced call's arguments
    validate against its model."""
    import openai

    tools = [
        openai.pydantic_function_tool(Customer, name="add_customer"),
        openai.pydantic_function_tool(Paint, name="paint"),
    ]
    models = {"add_customer": Customer, "paint": Paint}
    for choice in ("required", {"type": "function", "function": {"name": "add_customer"}}):
        r = api.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Add Ann Lee of 5 Elm Street as a customer."}],
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=120,
        )
        [call] = r.choices[0].message.tool_calls
        models[call.function.name].model_validate_json(call.function.arguments)


def test_a_streamed_tool_call_arrives_in_openai_shape(api):
    stream = api.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo, please."}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    name, arguments, finish, content, fragments = None, "", None, "", 0
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta and delta.tool_calls:
            for call in delta.tool_calls:
                assert call.index == 0
                name = call.function.name or name
                arguments += call.function.arguments or ""
                fragments += bool(call.function.arguments)
        if delta and delta.content:
            content += delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert (name, finish, content) == ("get_weather", "tool_calls", "")
    assert valid_weather(arguments)
    assert fragments > 3  # the arguments arrive as they are generated


def test_a_tool_round_trip_reuses_the_cache(api):
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    first = api.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        extra_body={"prompt_cache_key": "tool-trip"},
    )
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    final = api.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        temperature=0,
        max_tokens=24,
        extra_body={"prompt_cache_key": "tool-trip"},
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


def test_constrained_and_free_streams_side_by_side(api):
    results: dict[str, str] = {}

    def run(name: str, constrained: bool):
        kwargs = {"response_format": Person} if constrained else {}
        prompt = "Describe a fictional person." if constrained else "Tell a short story."
        messages = [{"role": "user", "content": prompt}]
        if constrained:
            with api.client.chat.completions.stream(
                model=MODEL, messages=messages, temperature=0, max_tokens=80, **kwargs
            ) as s:
                results[name] = s.get_final_completion().choices[0].message.parsed
        else:
            stream = api.client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=40, stream=True
            )
            results[name] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(f"c{i}", True)) for i in range(2)] + [
        threading.Thread(target=run, args=(f"f{i}", False)) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(isinstance(results[f"c{i}"], Person) for i in range(2)), results
    for i in range(2):
        text = results[f"f{i}"]
        assert text.strip() and not text.lstrip().startswith("{"), text


def error_of(api, body: dict) -> dict:
    r = api.request("POST", "/v1/chat/completions", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    "body,named",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "format": "no-such-format"},
                    },
                }
            },
            "no-such-format",
        ),
        ({"tools": [{"type": "function", "function": {"description": "nameless"}}]}, "name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "nope",
        ),
        ({"messages": [*HELLO, {"role": "tool", "content": "21 degrees"}]}, "tool_call_id"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "object",
        ),
    ],
    ids=[
        "invalid-schema",
        "unsupported-keyword",
        "nameless-tool",
        "unknown-tool",
        "tool-without-id",
        "parameters-not-an-object",
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_leaves_the_conversation(api, body, named):
    key = "kept-conversation"

    def hello():
        return api.client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
            extra_body={"prompt_cache_key": key},
        )  # fmt: skip

    first = hello()
    error = error_of(api, {"messages": HELLO, "prompt_cache_key": key, **body})
    assert named in error["message"] or named in (error["param"] or ""), error
    again = hello()
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
