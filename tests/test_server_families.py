"""The model families through the real server (issue 77): each family's tiny model saved as
a folder (tests/families.py) and served; a chat, a second turn from the cache, an edited
history rewound, a spill restored across a restart and four concurrent sessions batched,
each greedy reply equal to what the same history gets from a fresh session.

The families here carry the layer kinds the server must hold beside the policy's caches:
recurrent state (qwen3_next's Gated DeltaNet, lfm2's convolutions, nemotron_h's Mamba with
MLP-only layers), Gemma 4's KV-shared layers, DeepSeek's MLA latent and gpt-oss's sinks
(scored: h2o). Each also answers a streamed forced tool call (its byte-level vocabulary
spells any JSON). Qwen3.5 is the qwen3_next layout under a `text_config`: its start and a
reply are checked in test_qwen3_5_serves (transformers gives its folder Qwen's own
tokenizer class, rebuilt from this vocabulary).
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import jsonschema
import pytest
from families import SPECIAL, write_folder
from openai import OpenAI
from server_harness import running_server

pytestmark = pytest.mark.slow(seconds=150)

# family -> serve flags: a budget that evicts (auto picks what the model holds).
FAMILIES = {
    "qwen3_next": ["--policy", "h2o"],
    "lfm2": ["--policy", "h2o-merge"],
    "nemotron_h": ["--policy", "h2o-q8", "--kv-group-size", "32"],
    "gemma4_text": ["--policy", "auto"],
    "deepseek_v3": ["--policy", "auto"],
    "gpt_oss": ["--policy", "h2o"],
}
FIRST = [{"role": "user", "content": " ".join(f"w{i % 9}" for i in range(30))}]


def _client(server) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)


def _chat(client: OpenAI, messages: list, key: str) -> tuple[str, int]:
    reply = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=6,
        temperature=0,
        # Text only: a random model's special tokens would not survive the history's
        # rendering, and a wrapped window layer cannot rewind past them.
        logit_bias=NO_SPECIALS,
        extra_body={"prompt_cache_key": key},
    )
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    return {family: write_folder(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_sessions_through_the_server(family, folders, tmp_path):
    flags = ["--model", str(folders[family]), "--max-sessions", "4", "--kv-budget", "192KiB"]
    flags += [*FAMILIES[family], "--spill-dir", str(tmp_path / "spill"), "--spill-budget", "64MiB"]
    with running_server(tmp_path, *flags) as server:
        client = _client(server)
        first, cached = _chat(client, FIRST, "s1")
        assert cached == 0 and isinstance(first, str)
        second = [*FIRST, _said(first), _asks("w5")]
        _, cached = _chat(client, second, "s1")
        assert cached > 0, "the second turn continues the first one's cache"
        # An edited history (another assistant reply): rewound where the layers allow
        # (a state layer to its checkpoint at the prompt's end), else rebuilt; either way
        # the reply is what a fresh session says.
        edited = [*FIRST, _said("w7 w7"), _asks("w1")]
        rewound, _ = _chat(client, edited, "s1")
        assert rewound == _chat(client, edited, "fresh-1")[0]
        # Four sessions at once decode in one batch; each reply is what it gets alone.
        prompts = [[_asks(f"w{i} w{i + 1} w2 w3")] for i in range(4)]
        with cf.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda i: _chat(client, prompts[i], f"b{i}")[0], range(4)))
        alone = [_chat(client, p, f"alone-{i}")[0] for i, p in enumerate(prompts)]
        assert together == alone
        # A forced tool call, streamed: tool_calls deltas whose arguments fit the schema.
        name, arguments = _forced_call(client)
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
        # The reply s1's next turn gets without a restart: a twin given s1's turns.
        third = [*edited, _said(rewound), _asks("w2")]
        for messages in (FIRST, second, edited):
            _chat(client, messages, "twin")
        expected = _chat(client, third, "twin")[0]
        assert "error" not in server.log_text().lower(), server.log_text()[-2000:]
    with running_server(tmp_path, *flags) as server:  # s1 spilled at shutdown, restored now
        continued, cached = _chat(_client(server), third, "s1")
        assert cached > 0, "the spilled session came back with its cache"
        assert continued == expected


NO_SPECIALS = {str(i): -100 for i in range(len(SPECIAL))}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _forced_call(client: OpenAI) -> tuple[str, str]:
    """A streamed `tool_choice: required` turn: the call's name and its arguments."""
    stream = client.chat.completions.create(
        model="default",
        messages=[_asks("weather in Paris?")],
        tools=[WEATHER],
        tool_choice="required",
        stream=True,
        max_tokens=80,
        temperature=0,
    )
    name, arguments, finish = None, "", None
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name = call.function.name or name
            arguments += call.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls", finish
    return name, arguments


def _said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _asks(text: str) -> dict:
    return {"role": "user", "content": text}


def test_qwen3_5_serves(tmp_path):
    folder = write_folder("qwen3_5", tmp_path / "qwen3_5")
    with running_server(tmp_path, "--model", str(folder), "--policy", "h2o") as server:
        reply = _client(server).chat.completions.create(
            model="default", messages=FIRST, max_tokens=4, temperature=0
        )
        assert reply.usage.completion_tokens == 4
