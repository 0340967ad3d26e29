"""A thinking model's reasoning kept apart from its content, in every API, streamed or not,
and switched off by each API's switch (tests/thinking_model.py: replies known in advance).
"""

from __future__ import annotations

import pytest
from server_harness import running_server
from thinking_model import CONTENT, REASONING, write_thinking_model

from server.api.reasoning import ThinkingSplit, opened_in_prompt

ASK = [{"role": "user", "content": "What is 2+2?"}]


def _split(pieces: list[str], opened: bool = False) -> tuple[str, str]:
    split, out = ThinkingSplit("<think>", "</think>", opened), {"reasoning": "", "content": ""}
    for i, piece in enumerate(pieces):
        for kind, text in split.feed(piece, final=i == len(pieces) - 1):
            out[kind] += text
    return out["reasoning"], out["content"]


@pytest.mark.parametrize(
    "pieces",
    [
        ["<think>\nplan</think>\n\nanswer"],
        ["<thi", "nk>pl", "an</th", "ink>", "\n\nans", "wer"],  # tags cut anywhere
        [" ", "<think>", "plan", "</think>", "answer"],
    ],
)
def test_the_split_finds_tags_cut_across_deltas(pieces):
    assert _split(pieces) == ("plan", "answer")


def test_the_split_passes_a_reply_that_does_not_think():
    assert _split(["<b>bold</b>", " text"]) == ("", "<b>bold</b> text")
    assert _split(["<", "thin"]) == ("", "<thin")  # a tag that never came: content at the end
    assert _split(["plan</think>answer"], opened=True) == ("plan", "answer")
    assert _split(["plan so far"], opened=True) == ("plan so far", "")  # cut while thinking


def test_a_prompt_that_opens_the_block():
    assert opened_in_prompt("<|im_start|>assistant\n<think>\n", "<think>", "</think>")
    assert not opened_in_prompt("assistant\n<think>\n\n</think>\n\n", "<think>", "</think>")
    assert not opened_in_prompt("assistant\n", "<think>", "</think>")


@pytest.fixture(scope="module", params=[False, True], ids=["model-opens", "template-opens"])
def thinker(request, tmp_path_factory):
    folder = write_thinking_model(tmp_path_factory.mktemp("thinker"), opens=request.param)
    with running_server(folder.parent, "--model", str(folder), "--kv-budget", "64MiB") as s:
        s.model = s.client.models.list().data[0].id
        s.opens = request.param  # the reply then starts inside the block: no <think> token
        yield s


def _chat(server, **kwargs):
    return server.client.chat.completions.create(
        model=server.model, messages=ASK, temperature=0, max_tokens=20, **kwargs
    )


def test_chat_completions_reasoning_content(thinker):
    message = _chat(thinker).choices[0].message
    assert message.content == CONTENT
    assert message.model_extra["reasoning_content"].strip() == REASONING
    usage = _chat(thinker).usage
    thought = len(["hmm", "let", "me", "see", "</think>"]) + (not thinker.opens)  # <think>
    assert usage.completion_tokens_details.reasoning_tokens == thought
    reasoning, content = "", ""
    for chunk in _chat(thinker, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning.strip(), content) == (REASONING, CONTENT)


@pytest.mark.parametrize(
    "switch",
    [
        {"reasoning_effort": "none"},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    ],
)
def test_chat_completions_thinking_switched_off(thinker, switch):
    message = _chat(thinker, **switch).choices[0].message
    # (this tokenizer joins words with spaces: the first word after the prompt's
    # "</think>" reads " The"; with no thinking block the content is the text as it is)
    assert message.content.strip() == CONTENT
    assert "reasoning_content" not in (message.model_extra or {})


def _respond(server, **kwargs):
    return server.client.responses.create(
        model=server.model, input=ASK[0]["content"], temperature=0, max_output_tokens=20, **kwargs
    )


def test_responses_reasoning_items(thinker):
    r = _respond(thinker)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text.strip() == REASONING and r.output_text == CONTENT
    thought = len(["hmm", "let", "me", "see", "</think>"]) + (not thinker.opens)  # <think>
    assert r.usage.output_tokens_details.reasoning_tokens == thought
    reasoning, content, kinds = "", "", []
    for event in _respond(thinker, stream=True):
        kinds.append(event.type)
        if event.type == "response.reasoning_text.delta":
            reasoning += event.delta
        elif event.type == "response.output_text.delta":
            content += event.delta
    assert (reasoning.strip(), content) == (REASONING, CONTENT)
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # the reasoning item goes back with the chain (the template drops it: it keeps none)
    again = _respond(thinker, previous_response_id=r.id)
    assert again.output_text == CONTENT


def test_responses_thinking_switched_off_by_reasoning_effort(thinker):
    r = _respond(thinker, reasoning={"effort": "none"})
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text.strip() == CONTENT and r.usage.output_tokens_details.reasoning_tokens == 0
    streamed = [e.type for e in _respond(thinker, reasoning={"effort": "none"}, stream=True)]
    assert "response.reasoning_text.delta" not in streamed


def _message(server, **kwargs):
    import anthropic

    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    return client, {
        "model": server.model,
        "messages": ASK,
        "max_tokens": 20,
        "extra_body": {"temperature": 0},
        **kwargs,
    }


def test_messages_thinking_blocks(thinker):
    client, request = _message(thinker)
    message = client.messages.create(**request)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == REASONING and message.content[1].text == CONTENT
    thought = len(["hmm", "let", "me", "see", "</think>"]) + (not thinker.opens)
    assert message.usage.output_tokens_details.thinking_tokens == thought
    with client.messages.stream(**request) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    assert set(kinds) == {"thinking_delta", "text_delta"}
    assert final.content[0].thinking.strip() == REASONING and final.content[1].text == CONTENT
    # The reply's thinking block taken back in the next turn's history is accepted.
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in message.content]}]
    again = client.messages.create(**{**request, "messages": [*history, *ASK]})
    assert again.content[-1].text == CONTENT


def test_messages_thinking_disabled(thinker):
    client, request = _message(thinker, thinking={"type": "disabled"})
    message = client.messages.create(**request)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text.strip() == CONTENT
    with client.messages.stream(**request) as stream:
        kinds = {e.delta.type for e in stream if e.type == "content_block_delta"}
    assert kinds == {"text_delta"}
