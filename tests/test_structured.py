"""server/api/structured.py without a model: grammars, tools in the prompt, calls parsed back."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from server.api.chat.protocol import ChatCompletionRequest
from server.api.chat.turn import chat_turn
from server.api.errors import APIError
from server.api.structured import Function, ToolPlan, closed, render_tools
from server.api.tool_calls import ToolCallReader
from server.api.tool_formats.hermes import HermesJSON
from server.api.tool_formats.prompted import TOOLS_INTRO, PromptedJSON, _repointed
from server.api.turns import turn_grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PROMPTED = PromptedJSON(None, CALL_OPEN, CALL_CLOSE, {})  # a template without tools
NATIVE = HermesJSON(None, CALL_OPEN, CALL_CLOSE, {})

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def reply_grammar(body: ChatCompletionRequest):
    """(grammar, tool plan) of a chat request, as the engine makes them."""
    return turn_grammar(chat_turn(body, None, ""), PROMPTED)


def template_messages(body: ChatCompletionRequest, template_tools: bool):
    """(messages, tools argument) of a chat request for the chat template."""
    turn = chat_turn(body, None, "")
    offered = turn.functions if turn.tool_choice != "none" else []
    return render_tools(turn.messages, offered, NATIVE if template_tools else PROMPTED)


def test_text_and_no_tools_need_no_grammar():
    assert reply_grammar(request()) == (None, None)
    assert reply_grammar(request(response_format={"type": "text"})) == (None, None)
    assert reply_grammar(request(tools=[WEATHER], tool_choice="none")) == (None, None)


def test_json_formats_and_forced_calls_have_grammars():
    grammar, tools = reply_grammar(request(response_format={"type": "json_object"}))
    assert grammar and tools is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert reply_grammar(request(response_format=fmt))[0]
    grammar, tools = reply_grammar(request(tools=[WEATHER], tool_choice="required"))
    assert grammar and tools.forced and tools.names == {"get_weather"}
    grammar, tools = reply_grammar(request(tools=[WEATHER]))  # auto: free text, parsed after
    assert grammar is None and not tools.forced and tools.names == {"get_weather"}


@pytest.mark.parametrize(
    "schema,named",
    [({"type": "bogus"}, "bogus"), ({"type": "string", "format": "nope"}, "nope")],
)
def test_a_schema_the_engine_cannot_use_is_a_400_naming_it(schema, named):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    with pytest.raises(APIError) as e:
        reply_grammar(request(response_format=fmt))
    assert e.value.status == 400 and named in e.value.message
    assert e.value.param == "response_format.json_schema.schema"


def test_a_forced_call_comes_first_and_the_format_shapes_a_later_answer():
    """OpenAI takes both: tool_choice governs the call, response_format the final text."""
    fmt = {"type": "json_object"}
    forced, plan = reply_grammar(request(tools=[WEATHER], tool_choice="required"))
    both, both_plan = reply_grammar(
        request(tools=[WEATHER], tool_choice="required", response_format=fmt)
    )
    assert both == forced and both_plan == plan and plan.forced
    # Under auto the reply is either calls or the format's JSON: one grammar for both.
    either, auto = reply_grammar(request(tools=[WEATHER], response_format=fmt))
    assert either and not auto.forced
    for text, ok in [
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', True),
        ('{"answer": 1}', True),
        ('<tool_call>{"name": "other", "arguments": {}}</tool_call>', False),
        ("plain text", False),
    ]:
        assert _matches(either, text) == ok, text


def _matches(grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (bytes, no model: llguidance's byte tokenizer)."""
    from llguidance import LLTokenizer

    matcher = LLMatcher(LLTokenizer("byte"), grammar)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def test_objects_that_name_their_properties_are_closed_for_the_grammar():

    open_ = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    assert closed(open_) == {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {}, "additionalProperties": False}},
        "additionalProperties": False,
    }
    extra = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}}
    assert closed(extra) == extra  # extra keys with a schema of their own stay
    free = {"type": "object"}  # json_object: any object
    assert closed(free) == free
    composed = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed(composed) == composed  # each branch names only some of the keys
    assert closed({"enum": [{"properties": {}}]}) == {"enum": [{"properties": {}}]}


def test_tools_go_into_the_system_message_of_a_template_without_a_tools_section():
    body = request(
        tools=[WEATHER],
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
        ],
    )
    messages, tools = template_messages(body, template_tools=False)
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.\n\n" + TOOLS_INTRO)
    assert '"name": "get_weather"' in messages[0]["content"]
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    assert messages[2]["content"] == f"{CALL_OPEN}{call}{CALL_CLOSE}"
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}
    messages, tools = template_messages(body, template_tools=True)
    assert tools[0]["function"]["name"] == "get_weather" and messages[0]["content"] == "Be brief."
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def read(plan: ToolPlan, text: str, step: int = 1000, cut: bool = False):
    """(events, calls and content) of a reply fed to a ToolCallReader `step` characters
    at a time."""
    reader, events = ToolCallReader(plan), []
    for at in range(0, len(text), step):
        events += reader.feed(text[at : at + step])
    events += reader.feed("", final=True, cut=cut)
    return events, reader.result()


WEATHER_FN = Function("get_weather", None, WEATHER["function"]["parameters"])


def test_calls_are_parsed_from_forced_and_auto_replies():
    plan = ToolPlan(True, PROMPTED, [WEATHER_FN])
    _, ([call], content) = read(plan, '{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert content is None and call["type"] == "function" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    two = '[{"name": "get_weather", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'
    assert len(read(plan, two)[1][0]) == 2
    auto = ToolPlan(False, PROMPTED, [WEATHER_FN])
    text = f' {CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}{CALL_CLOSE}'
    assert read(auto, text)[1][0][0]["function"]["name"] == "get_weather"
    assert read(auto, "It is sunny.")[1] is None
    unknown = f'{CALL_OPEN}{{"name": "other", "arguments": {{}}}}{CALL_CLOSE}'
    assert read(auto, unknown) == ([("text", unknown)], None)  # a call of nothing offered: text
    cut = f'{CALL_OPEN}{{"name": "get_wea'
    assert read(auto, "Sure. " + cut, cut=True) == ([("text", "Sure. ")], None)


def test_an_auto_reply_is_held_back_only_while_it_may_become_a_call():
    auto = ToolPlan(False, PROMPTED, [WEATHER_FN])
    reader = ToolCallReader(auto)
    assert reader.feed("Hello <b> and <tool") == [("text", "Hello <b> and ")]
    assert reader.feed("box>") == [("text", "<toolbox>")]  # not the marker after all
    assert reader.feed(f" {CALL_OPEN}{{") == [("text", " ")]  # held from the marker on


@pytest.mark.parametrize(
    "fields,param",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools",
        ),
    ],
)
def test_bad_tool_fields_fail_validation_naming_the_field(fields, param):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        request(**fields)
    assert e.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_forced_calls_stream_as_name_then_argument_fragments(step):
    text = (
        '[{"name": "get_weather", "arguments": {"city": "Ro\\"me}\\\\", "n": [1, {"a": 2}]}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    functions = [WEATHER_FN, Function("get_time")]
    events, _ = read(ToolPlan(True, PROMPTED, functions), text, step)
    heads = [e for e in events if e[0] == "call"]
    assert [(e[1], e[3]) for e in heads] == [(0, "get_weather"), (1, "get_time")]
    arguments = ["", ""]
    for e in events:
        if e[0] == "arguments":
            arguments[e[1]] += e[2]
    assert [json.loads(a) for a in arguments] == [c["arguments"] for c in json.loads(text)]
    if step == 1:  # fragments as the arguments grow, not one at the end
        assert sum(1 for e in events if e[0] == "arguments" and e[1] == 0) > 10


def _arguments_schema(parameters: dict, i: int) -> dict:
    """Function i's parameters as a forced prompted call's grammar holds them."""
    return _repointed({**closed(parameters), "type": "object"}, f"#/$defs/f{i}")


def test_a_forced_call_with_an_untyped_schema_still_takes_an_object():
    """parameters {} would admit any JSON value; a call's arguments must be an object."""
    assert _arguments_schema({"properties": {"a": {"type": "integer"}}}, 0) == {
        "properties": {"a": {"type": "integer"}},
        "type": "object",
        "additionalProperties": False,
    }
    untyped = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert reply_grammar(request(tools=[untyped], tool_choice="required"))[0]


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_local_refs_resolve_inside_their_own_function():
    """pydantic puts nested models in `$defs` and refers to them from the parameters'
    root ("#/$defs/..."); a recursive schema refers to "#". Inside a forced call those
    roots are the function's own (two functions may both name an `Inner`), and a
    property named like a keyword ("default") is a schema still."""
    inner = {"$defs": {"Inner": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    first = {
        **inner,
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/Inner"}, "default": {"$ref": "#/$defs/Inner"}},
        "required": ["x"],
    }
    other = {"$defs": {"Inner": {"type": "string"}}, "properties": {"y": {"$ref": "#/$defs/Inner"}}}
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}, "enum": {"enum": ["#"]}}}
    args = _arguments_schema(first, 0)
    assert args["properties"]["x"] == {"$ref": "#/$defs/f0/$defs/Inner"}
    assert args["properties"]["default"] == {"$ref": "#/$defs/f0/$defs/Inner"}
    assert _arguments_schema(tree, 2)["properties"] == {
        "child": {"$ref": "#/$defs/f2"},
        "enum": {"enum": ["#"]},
    }
    tools = [tool("first", first), tool("other", other), tool("tree", tree)]
    for choice in ("required", {"type": "function", "function": {"name": "other"}}):
        grammar, plan = reply_grammar(request(tools=tools, tool_choice=choice))
        assert grammar and plan.forced
    # A schema with its own `$id` is a resource: its "#" is itself, wherever it sits.
    own = {"$id": "https://x/s", "type": "object", "$defs": {"A": {"type": "integer"}}}
    own["properties"] = {"a": {"$ref": "#/$defs/A"}}
    nested = {"type": "object", "properties": {"b": {**own, "$id": "https://x/b"}}}
    either = {"type": ["object", "null"], "properties": {"c": {"type": "integer"}}}
    assert _arguments_schema(own, 0) == {**own, "type": "object", "additionalProperties": False}
    assert _arguments_schema(either, 0)["type"] == "object"  # a call's arguments: an object
    for parameters in (own, nested, either):
        assert reply_grammar(request(tools=[tool("t", parameters)], tool_choice="required"))[0]
    with pytest.raises(APIError):  # a ref to nowhere is still the client's error
        broken = tool("broken", {"type": "object", "properties": {"z": {"$ref": "#/$defs/No"}}})
        reply_grammar(request(tools=[broken], tool_choice="required"))
