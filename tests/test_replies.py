"""Reply building without a model: OpenAI bodies and chunks, stop strings held back.

The bodies are checked against the openai SDK's own types, the shapes clients parse.
"""

from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from server.api.responses import ReplyBuilder
from server.engine.generation import StopText, stop_holdback
from server.engine.jobs import Delta, Finished, TokenLogprob


class Letters:
    """A tokenizer whose token i decodes to the letter 'a' + i."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


FINISHED = Finished(prompt_tokens=10, completion_tokens=2, cached_tokens=4)
LOGPROBS = [TokenLogprob(0, -0.1, [(0, -0.1), (1, -2.5)]), TokenLogprob(1, -0.3, [])]


def test_chat_reply_is_an_openai_chat_completion():
    reply = ReplyBuilder("chat", "m", Letters(), include_usage=False)
    reply.add(Delta("Hel", LOGPROBS[:1]))
    reply.add(Delta("lo", LOGPROBS[1:], finish_reason="stop"))
    body = ChatCompletion.model_validate(reply.response(FINISHED))
    choice = body.choices[0]
    assert choice.message.content == "Hello" and choice.finish_reason == "stop"
    assert [t.token for t in choice.logprobs.content] == ["a", "b"]
    assert [t.token for t in choice.logprobs.content[0].top_logprobs] == ["a", "b"]
    assert body.usage.total_tokens == 12 and body.usage.prompt_tokens_details.cached_tokens == 4


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_chunks(include_usage):
    reply = ReplyBuilder("chat", "m", Letters(), include_usage=include_usage)
    first = reply.first_chunk()
    middle = reply.chunk(Delta("Hi"))
    finals = reply.final_chunks(FINISHED)
    chunks = [first, middle, *finals]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "role" not in middle["choices"][0]["delta"]  # a delta carries only what changed
    assert middle["choices"][0]["delta"] == {"content": "Hi"}
    assert finals[0]["choices"][0]["delta"] == {}
    assert len({c.id for c in parsed}) == 1
    if include_usage:  # OpenAI: usage null on every chunk, then one chunk with usage only
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
        assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 2
    else:
        assert all("usage" not in c for c in chunks) and len(finals) == 1


def test_text_completion_with_echo_and_logprobs():
    reply = ReplyBuilder("text", "m", Letters(), include_usage=False, echo="Say: ")
    reply.add(Delta("ab", LOGPROBS, finish_reason="length"))
    body = Completion.model_validate(reply.response(FINISHED))
    choice = body.choices[0]
    assert choice.text == "Say: ab" and choice.finish_reason == "length"
    assert choice.logprobs.tokens == ["a", "b"]
    assert choice.logprobs.text_offset == [5, 6]  # after the echoed prompt
    assert choice.logprobs.top_logprobs == [{"a": -0.1, "b": -2.5}, {}]


@pytest.mark.parametrize(
    "text, stops, held",
    [
        ("Hello Wo", ["World"], 2),
        ("Hello", ["World"], 0),
        ("abc", ["cd", "bcx"], 2),
        ("", ["x"], 0),
    ],
)
def test_stop_holdback(text, stops, held):
    assert stop_holdback(text, stops) == held


def test_stop_text_never_releases_part_of_a_stop_string():
    reply = StopText(["END"])
    assert reply.add("one E") == "one "  # "E" might start END
    assert reply.add("N") == ""
    assert reply.add("D two") == "" and reply.stopped and reply.text == "one "


def test_stop_text_releases_a_false_alarm_and_everything_at_the_end():
    reply = StopText(["END"])
    assert reply.add("an E") == "an "
    assert reply.add("gg") == "Egg"  # "Egg" cannot become "END" any more
    assert reply.add(" E", final=True) == " E" and not reply.stopped


def test_stop_text_without_stops_passes_everything():
    reply = StopText([])
    assert reply.add("a") + reply.add("b", final=True) == "ab"
