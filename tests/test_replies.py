"""Reply building without a model: OpenAI bodies and chunks, stop strings held back.

The bodies are checked against the openai SDK's own types, the shapes clients parse.
"""

from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tool_plans import prompted_plan

from server.api.chat.replies import ReplyBuilder
from server.engine.generation import StopText, stop_holdback
from server.engine.jobs import Delta, Finished, TokenLogprob


class Letters:
    """A tokenizer whose token i decodes to the letter 'a' + i."""

    def decode(self, ids: list[int], **_) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


FINISHED = Finished(prompt_tokens=10, completion_tokens=2, cached_tokens=4)
LOGPROBS = [TokenLogprob(0, -0.1, [(0, -0.1), (1, -2.5)]), TokenLogprob(1, -0.3, [])]


def test_chat_reply_is_an_openai_chat_completion():
    reply = ReplyBuilder("chat", "m", Letters(), include_usage=False)
    reply.add(Delta("Hel", LOGPROBS[:1]))
    reply.add(Delta("lo", LOGPROBS[1:], finish_reason="stop"))
    reply.finish(FINISHED)
    body = ChatCompletion.model_validate(reply.response())
    choice = body.choices[0]
    assert choice.message.content == "Hello" and choice.finish_reason == "stop"
    assert [t.token for t in choice.logprobs.content] == ["a", "b"]
    assert [t.token for t in choice.logprobs.content[0].top_logprobs] == ["a", "b"]
    assert body.usage.total_tokens == 12 and body.usage.prompt_tokens_details.cached_tokens == 4


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_chunks(include_usage):
    reply = ReplyBuilder("chat", "m", Letters(), include_usage=include_usage)
    first = reply.first_chunks()
    middle = reply.chunks(Delta("Hi"))
    last = reply.chunks(Delta("", finish_reason="stop"))
    reply.finish(FINISHED)
    usage = reply.usage_chunks()
    chunks = [*first, *middle, *last, *usage]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "role" not in middle[0]["choices"][0]["delta"]  # a delta carries only what changed
    assert middle[0]["choices"][0]["delta"] == {"content": "Hi"}
    assert last[-1]["choices"][0]["delta"] == {} and last[-1]["choices"][0]["finish_reason"]
    assert len({c.id for c in parsed}) == 1
    if include_usage:  # OpenAI: usage null on every chunk, then one chunk with usage only
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
        assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 2
    else:
        assert all("usage" not in c for c in chunks) and usage == []


def test_choices_are_numbered_job_by_job_and_usage_sums_the_jobs():
    reply = ReplyBuilder("text", "m", Letters(), False, [([0], ""), ([1], "")], n=2)
    for job in (0, 1):
        for i in (0, 1):
            reply.add(Delta(f"{job}{i}", choice=i, finish_reason="stop"), job)
        reply.finish(FINISHED)
    body = Completion.model_validate(reply.response())
    assert [(c.index, c.text) for c in body.choices] == [(0, "00"), (1, "01"), (2, "10"), (3, "11")]
    assert body.usage.prompt_tokens == 20 and body.usage.completion_tokens == 4


def test_text_completion_with_echo_and_logprobs():
    prompt = [18, 0, 24]  # "say": the echo's tokens, logprobs for all but the first
    reply = ReplyBuilder("text", "m", Letters(), include_usage=False, prompts=[(prompt, "say")])
    echoed = [None, TokenLogprob(0, -1.0, []), TokenLogprob(24, -2.0, [(24, -2.0)])]
    reply.add(Delta("ab", LOGPROBS, finish_reason="length", prompt_logprobs=echoed))
    reply.finish(FINISHED)
    # (the SDK's type says float, yet OpenAI sends null for the first: the SDK parses
    # replies without validating, so the body is read as a dict here)
    choice = reply.response()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "sayab" and choice["finish_reason"] == "length"
    assert logprobs["tokens"] == ["s", "a", "y", "a", "b"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"] == [None, -1.0, -2.0, -0.1, -0.3]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]  # into the text, echo included
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][3:] == [{"a": -0.1, "b": -2.5}, {}]


def test_a_forced_call_streams_one_entry_per_index_in_a_chunk():
    plan = prompted_plan(True, {"f"})
    reply = ReplyBuilder("chat", "m", Letters(), include_usage=False, tools=plan)
    chunks = reply.chunks(Delta('{"name": "f", "arguments": {"x": 1}}', finish_reason="stop"))
    entries = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
    assert [len(e) for e in entries if e] == [1, 1]  # the head, then the arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_forced_call_cut_by_max_tokens_is_a_call_with_partial_arguments():
    plan = prompted_plan(True, {"f"})
    reply = ReplyBuilder("chat", "m", Letters(), include_usage=False, tools=plan)
    reply.add(Delta('{"name": "f", "arguments": {"city": "Pa', finish_reason="length"))
    reply.finish(FINISHED)
    message = ChatCompletion.model_validate(reply.response()).choices[0].message
    assert message.content is None
    assert message.tool_calls[0].function.arguments == '{"city": "Pa'


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


def test_stop_text_names_the_stop_string_that_ended_it():
    reply = StopText(["two", "one"])  # the earliest in the text wins, not the first listed
    assert reply.add("zero one two") == "zero " and reply.matched == "one"
    assert StopText(["x"]).matched is None


def test_top_k_draws_only_among_the_k_likeliest():
    import mlx.core as mx

    from server.engine.generation import RequestSampler

    logprobs = mx.log(mx.array([[0.1, 0.4, 0.2, 0.3]]))
    top1 = RequestSampler(1.0, 1.0, 0.0, seed=7, top_k=1)
    assert {top1(logprobs).item() for _ in range(20)} == {1}
    top2 = RequestSampler(1.0, 1.0, 0.0, seed=7, top_k=2)
    assert {top2(logprobs).item() for _ in range(60)} == {1, 3}
    whole = RequestSampler(1.0, 1.0, 0.0, seed=7, top_k=4)  # the vocabulary: no filter
    assert len({whole(logprobs).item() for _ in range(100)}) == 4
