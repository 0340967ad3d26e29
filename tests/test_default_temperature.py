"""--default-temperature: a request that sends no temperature samples at the server's
default, in every API (agents send none); one that sends one keeps it."""

from __future__ import annotations

import anthropic
import pytest
from openai import OpenAI

from server.api.chat.protocol import ChatCompletionRequest, CompletionRequest
from server.api.chat.turn import chat_turn, completion_turn
from server.api.messages.protocol import MessagesRequest
from server.api.messages.turn import messages_turn
from server.api.responses.protocol import ResponseCreate
from server.api.responses.turn import responses_turn

ASK = [{"role": "user", "content": "Tell me a story about a dragon."}]


def _temperatures(extra: dict, default: float | None) -> list[float]:
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **extra})
    text = CompletionRequest.model_validate({"model": "m", "prompt": "Once", **extra})
    msg = MessagesRequest.model_validate({"model": "m", "messages": ASK, "max_tokens": 8, **extra})
    resp = ResponseCreate.model_validate({"model": "m", "input": "Once", **extra})
    return [
        chat_turn(chat, None, "", default).sampling.temperature,
        completion_turn(text, None, "", default).sampling.temperature,
        messages_turn(msg, "m", default_temperature=default).turn.sampling.temperature,
        responses_turn(resp, [], None, "", default).turn.sampling.temperature,
    ]


def test_each_api_takes_the_default_only_when_none_is_sent():
    assert _temperatures({}, None) == [1.0] * 4  # OpenAI's and Anthropic's own default
    assert _temperatures({}, 0.2) == [0.2] * 4
    assert _temperatures({"temperature": 0.7}, 0.2) == [0.7] * 4
    assert _temperatures({"temperature": 0}, 0.9) == [0.0] * 4  # 0 is sent, not absent


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory):
    from server_harness import running_server

    tmp = tmp_path_factory.mktemp("default-temperature")
    with running_server(tmp, "--default-temperature", "0", "--max-sessions", "4") as s:
        yield s


def test_a_request_without_temperature_is_greedy_under_default_zero(greedy_by_default):
    """Sampled at 1.0, 24 tokens of a story would not all match the greedy reply."""
    url = greedy_by_default.base_url
    openai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)

    def chat(**kw) -> str:
        r = openai.chat.completions.create(model="default", messages=ASK, max_tokens=24, **kw)
        return r.choices[0].message.content

    def message(**kw) -> str:  # the SDK no longer types sampling fields: extra_body
        m = claude.messages.create(model="default", messages=ASK, max_tokens=24, extra_body=kw)
        return m.content[0].text

    def response(**kw) -> str:
        r = openai.responses.create(
            model="default", input=ASK[0]["content"], max_output_tokens=24, store=False, **kw
        )
        return r.output_text

    for reply in (chat, message, response):
        assert reply() == reply(temperature=0), reply.__name__
