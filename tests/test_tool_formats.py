"""Each family's tool calls through the same path as served replies, without a model.

Per format (tests/tool_templates.py): a tokenizer whose chat template is that family's,
so mlx-lm infers the format as it would from the real one; the text such a model writes
fed to all three APIs' reply builders, whole and streamed in pieces; the forced-call
grammar checked against that text on the tokenizer's own vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from test_messages import _events as messages_events
from test_responses_replies import _reply as responses_reply
from test_responses_replies import _run as responses_run
from tool_templates import HARMONY_SPECIAL, SPECIAL, emit, template
from word_tokenizer import CHARS, save_word_tokenizer

from server.api.chat.replies import ReplyBuilder
from server.api.messages.replies import MessagesReply
from server.api.structured import Function, ToolPlan, closed, shape_grammar
from server.api.tool_calls import ToolCallReader
from server.api.tool_formats import format_for
from server.api.tool_formats.harmony import HarmonySplit
from server.engine.jobs import Delta, Finished

WEATHER = Function(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
)
TIME = Function("get_time", None, {"type": "object", "properties": {"zone": {"type": "string"}}})
# "42" is a string the XML formats write bare: it must stay a string, and 3 a number.
CALL = ("get_weather", {"city": "42", "days": 3})
SECOND = ("get_time", {"zone": "CET"})
FORMATS = ["qwen3_coder", "glm47", "mistral", "kimi_k2", "json_tools", "gemma4", "pythonic",
           "llama3_json", "harmony"]  # fmt: skip
ONE_CALL = ("harmony", "llama3_json")  # formats that write one call a reply
WITH_GRAMMAR = ["qwen3_coder", "glm47", "mistral", "kimi_k2", "json_tools", "llama3_json",
                "harmony"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    from mlx_lm.tokenizer_utils import load

    out = {}
    for name in [*FORMATS, "none"]:
        folder = Path(tmp_path_factory.mktemp(name))
        # Llama's vocabulary has no other family's markers (mlx-lm reads some from it).
        special = {"harmony": HARMONY_SPECIAL, "llama3_json": SPECIAL[:3]}.get(name, SPECIAL)
        eos = "<|return|>" if name == "harmony" else "<|im_end|>"
        text = template(name) if name != "none" else "{{ messages[0].content }}"
        save_word_tokenizer(folder, special + CHARS, special, eos, text)
        out[name] = load(folder)
    return out


def plan(tokenizers, name: str, forced: bool = False) -> ToolPlan:
    return ToolPlan(forced, format_for(tokenizers[name]), [WEATHER, TIME])


def pieces(text: str, step: int) -> list[str]:
    return [text[i : i + step] for i in range(0, len(text), step)] or [""]


def split_for(name: str):
    return HarmonySplit if name == "harmony" else None


def chat(tokenizers, name: str, text: str, step: int, forced: bool = False):
    """(calls as [(name, arguments)], content) from the streamed chunks and the body."""
    reply = ReplyBuilder(
        "chat", "m", tokenizers[name], False, tools=plan(tokenizers, name, forced),
        thinking=split_for(name),
    )  # fmt: skip
    calls: dict[int, list] = {}
    content = ""
    parts = pieces(text, step)
    for i, piece in enumerate(parts):
        finish = "stop" if i == len(parts) - 1 else None
        for chunk in reply.chunks(Delta(piece, finish_reason=finish)):
            delta = ChatCompletionChunk.model_validate(chunk).choices[0].delta
            content += delta.content or ""
            for entry in delta.tool_calls or []:
                if entry.id:
                    calls[entry.index] = [entry.function.name, ""]
                calls[entry.index][1] += entry.function.arguments or ""
    reply.finish(Finished(5, len(parts), 0))
    body = ChatCompletion.model_validate(reply.response()).choices[0]
    streamed = [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]
    whole = [(c.function.name, json.loads(c.function.arguments))
             for c in body.message.tool_calls or []]  # fmt: skip
    assert streamed == whole and content.strip() == (body.message.content or "").strip()
    if whole:
        assert body.finish_reason == "tool_calls"
    return whole, content.strip()


def responses(tokenizers, name: str, text: str, step: int):
    reply, _ = responses_reply(plan(tokenizers, name))
    if name == "harmony":
        reply.split = HarmonySplit()
    events = responses_run(reply, pieces(text, step))
    final = Response.model_validate(events[-1]["response"])
    calls = [(i.name, json.loads(i.arguments)) for i in final.output if i.type == "function_call"]
    return calls, final.output_text.strip()


def messages(tokenizers, name: str, text: str, step: int):
    reply = MessagesReply("m", tokenizers[name], [1], tools=plan(tokenizers, name),
                          thinking=split_for(name))  # fmt: skip
    deltas = [Delta(p) for p in pieces(text, step)]
    deltas[-1].finish_reason = "stop"
    events = messages_events(reply, deltas, Finished(5, len(deltas), 0))
    inputs: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            inputs[e["index"]] = inputs.get(e["index"], "") + e["delta"]["partial_json"]
    body = Message.model_validate(reply.body())
    whole = [(b.name, b.input) for b in body.content if b.type == "tool_use"]
    assert [json.loads(v) for _, v in sorted(inputs.items())] == [a for _, a in whole]
    text_out = "".join(b.text for b in body.content if b.type == "text").strip()
    return whole, text_out


API = {"chat": chat, "responses": responses, "messages": messages}


def valid(calls) -> bool:
    schemas = {f.name: f.parameters for f in (WEATHER, TIME)}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    return True


def test_the_format_comes_from_the_template(tokenizers):
    for name in FORMATS:
        assert format_for(tokenizers[name]).name == name
    fallback = format_for(tokenizers["none"])
    assert fallback.name == "prompted_json" and not fallback.native


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "harmony"])
def test_earlier_calls_render_as_the_model_writes_them(tokenizers, name):
    tok = tokenizers[name]
    function = {"name": CALL[0], "arguments": CALL[1]}
    call = {"id": "functions.get_weather:0", "type": "function", "function": function}
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": f.described()} for f in (WEATHER, TIME)]
    text = tok.apply_chat_template(history, tools=tools, tokenize=False)
    assert emit(name, [CALL]) in text and '"name": "get_time"' in text


@pytest.mark.parametrize("api", API)
@pytest.mark.parametrize("step", [1, 7, 100000])
@pytest.mark.parametrize("name", FORMATS)
def test_a_call_after_text_parses_streamed_and_whole(tokenizers, name, step, api):
    text = emit(name, [CALL], before="Let me look.\n")
    calls, content = API[api](tokenizers, name, text, step)
    assert calls == [CALL] and valid(calls)
    assert content == "Let me look."


@pytest.mark.parametrize("api", API)
@pytest.mark.parametrize("name", [n for n in FORMATS if n not in ONE_CALL])
def test_two_calls_in_one_reply(tokenizers, name, api):
    text = emit(name, [CALL, SECOND])
    for step in (3, 100000):
        calls, content = API[api](tokenizers, name, text, step)
        assert calls == [CALL, SECOND] and content == ""


@pytest.mark.parametrize("api", API)
@pytest.mark.parametrize("name", FORMATS)
def test_a_malformed_call_is_text(tokenizers, name, api):
    """A call of a function nobody offered, or one that does not parse, is the text it was."""
    broken = emit(name, [CALL])
    broken = broken[:-1] if name == "harmony" else broken.replace("get_weather", "get weather")
    for text in [emit(name, [("no_such_tool", {"a": 1})]), broken]:
        calls, content = API[api](tokenizers, name, text, 5)
        assert calls == [] and content, text
        assert "no_such_tool" in content or "get weather" in content or name == "harmony"


@pytest.mark.parametrize("name", WITH_GRAMMAR)
def test_a_forced_call_is_the_formats_own_text(tokenizers, name):
    """The forced grammar takes exactly what the family writes (checked token by token on
    its vocabulary) and refuses a wrong type; the reply reads back schema-valid."""
    from server.engine.grammar import Grammars

    tok = tokenizers[name]
    fmt = format_for(tok)
    grammars = Grammars(tok, max(tok.get_vocab().values()) + 1)
    many = name not in ONE_CALL
    grammar, forced = shape_grammar([WEATHER, TIME], "required", many, None, fmt)
    calls = [CALL, SECOND] if many else [CALL]

    def takes(text: str) -> bool:
        constraint = grammars.constraint(grammar)
        ok = all(
            constraint.matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)
        )
        return ok and constraint.matcher.is_accepting()

    text = emit(name, calls)
    assert takes(text), text
    assert not takes(emit(name, [("get_weather", {"city": "42", "days": "three"})]))
    assert chat(tokenizers, name, text, 4, forced=True)[0] == calls
    named, _ = shape_grammar([WEATHER, TIME], "get_time", True, None, fmt)
    assert named != grammar


@pytest.mark.parametrize("name", WITH_GRAMMAR)
def test_tools_and_an_answer_schema_take_either_a_call_or_the_answer(tokenizers, name):
    from server.engine.grammar import Grammars

    tok = tokenizers[name]
    fmt = format_for(tok)
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar, tools = shape_grammar([WEATHER, TIME], "auto", True, answer, fmt)
    assert not tools.forced
    grammars = Grammars(tok, max(tok.get_vocab().values()) + 1)
    prefix = "<|channel|>final<|message|>" if name == "harmony" else ""
    for text, ok in [(emit(name, [CALL]), True), (prefix + '{"n": 4}', True), ("hello", False)]:
        constraint = grammars.constraint(grammar)
        took = all(
            constraint.matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)
        )
        assert (took and constraint.matcher.is_accepting()) == ok, text


def test_harmony_reasoning_and_answer_come_apart(tokenizers):
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
            "<|channel|>final<|message|>It is sunny.")  # fmt: skip
    for step in (1, 6, 1000):
        reply = ReplyBuilder("chat", "m", tokenizers["harmony"], False, thinking=HarmonySplit)
        parts = pieces(text, step)
        for i, piece in enumerate(parts):
            reply.add(Delta(piece, finish_reason="stop" if i == len(parts) - 1 else None))
        message = ChatCompletion.model_validate(reply.response()).choices[0].message
        assert message.content == "It is sunny."
        assert message.reasoning_content == "Need the weather."


def test_xml_arguments_take_the_schemas_types():
    """qwen3_coder writes every value as text: the schema decides what it is."""
    from server.api.tool_calls import coerce

    schema = closed(WEATHER.parameters)
    assert coerce({"city": 42, "days": "3"}, schema) == {"city": "42", "days": 3}
    assert coerce({"city": "Oslo", "days": "x"}, schema) == {"city": "Oslo", "days": "x"}
    flag = {"properties": {"on": {"type": "boolean"}}}
    assert coerce({"on": "True"}, flag) == {"on": True} and coerce({"on": "false"}, flag) == {
        "on": False
    }


def test_a_cut_auto_call_is_dropped_and_a_cut_forced_one_kept(tokenizers):
    text = emit("qwen3_coder", [CALL])
    reader = ToolCallReader(plan(tokenizers, "qwen3_coder"))
    assert reader.feed("Sure. " + text[:30], final=True, cut=True) == [("text", "Sure. ")]
    forced = ToolCallReader(plan(tokenizers, "qwen3_coder", forced=True))
    forced.feed(text[: text.index("<parameter=days>")], final=True, cut=True)
    [call], _ = forced.result()
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"city": "42"'  # as far as it got


@pytest.mark.parametrize("name", ["qwen3_coder", "glm47"])
def test_a_forced_xml_call_streams_each_parameter_as_it_closes(tokenizers, name):
    text = emit(name, [CALL])
    reader = ToolCallReader(plan(tokenizers, name, forced=True))
    pieces = []
    for ch in text:
        pieces += [e[2] for e in reader.feed(ch) if e[0] == "arguments"]
    pieces += [e[2] for e in reader.feed("", final=True) if e[0] == "arguments"]
    assert pieces == ['{"city": "42"', ', "days": 3', "}"]


@pytest.mark.parametrize("name", ["gemma4", "pythonic"])
def test_a_forced_call_in_a_format_without_a_grammar_opens_with_its_marker(tokenizers, name):
    """No schema grammar here for these: the forced reply is the marker, text, the end
    marker; it is read like an auto reply."""
    from server.engine.grammar import Grammars

    tok = tokenizers[name]
    fmt = format_for(tok)
    grammar, _ = shape_grammar([WEATHER, TIME], "required", False, None, fmt)
    constraint = Grammars(tok, max(tok.get_vocab().values()) + 1).constraint(grammar)
    text = emit(name, [CALL])
    ids = tok.encode(text, add_special_tokens=False)
    assert all(constraint.matcher.consume_token(t) for t in ids)
    assert constraint.matcher.is_accepting()
    assert chat(tokenizers, name, text, 3, forced=True)[0] == [CALL]
    refused = Grammars(tok, max(tok.get_vocab().values()) + 1).constraint(grammar)
    assert not refused.matcher.consume_token(tok.encode("x", add_special_tokens=False)[0])
