"""Real agent clients against a model that writes Qwen3-Coder's tool calls.

The model is scripted (tests/scripted_model.py): after the generation prompt it writes
one call in Qwen3-Coder's XML; after a tool result (its template cues the answer) it
answers in text. Served for real, the clients run their own loops: the call must reach
them parsed (as `tool_calls`, a `function_call` item, a `tool_use` block), they run the
tool, send the result back, and take the answer:
- the OpenAI Agents SDK (chat completions and its default, the Responses API),
- the anthropic SDK's tool runner,
- Codex CLI, one `codex exec` turn calling its `exec_command` tool,
- Claude Code, one `claude -p` turn whose Agent tool runs a haiku subagent on a second
  model of the same server.
The two CLIs are npm packages that make setup installs into .venv/agents (CODEX_BIN and
CLAUDE_BIN name others); skipped where they are not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import anthropic
import openai
import pytest
from families import TEMPLATE
from scripted_model import chain, write_chain_model
from server_harness import running_server
from tool_templates import template

pytestmark = pytest.mark.slow(seconds=60)

SPECIAL = ["<|im_start|>", "<|im_end|>", "[UNK]", "<|answer|>"]
WORDS = ["system", "user", "assistant", "tool", "developer"]
ANSWER = "The tool said so: done."


def call_text(name: str, **params: str) -> str:
    """One call as Qwen3-Coder writes it (and its template renders it back)."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def scripted(folder, name: str, **params: str):
    """A model that calls `name`(**params) and, given the result, answers ANSWER."""
    cued = template("qwen3_coder").replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if messages[-1].role == 'tool' %}<|answer|>{% endif %}"
        "{% endif %}",
    )
    assert cued != template("qwen3_coder")
    call = call_text(name, **params)
    after = {**chain("assistant", call, "<|im_end|>"), **chain("<|answer|>", ANSWER, "<|im_end|>")}
    write_chain_model(folder, SPECIAL, WORDS, after, "<|im_end|>", cued, [call, ANSWER])
    return folder


def replying(folder, reply: str):
    """A model whose every reply is `reply` (ChatML, no tools)."""
    after = chain("assistant", reply, "<|im_end|>")
    write_chain_model(folder, SPECIAL, WORDS, after, "<|im_end|>", TEMPLATE, [reply])
    return folder


@pytest.fixture(scope="module")
def weather(tmp_path_factory):
    root = tmp_path_factory.mktemp("weather")
    folder = scripted(root / "model", "get_weather", city="Paris")
    with running_server(root, "--model", str(folder), "--served-model-name", "local-model") as s:
        yield s


def test_openai_agents_sdk_runs_the_tool_and_answers(weather):
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIProvider, RunConfig, Runner
    from weather_tool import weather_function_tool

    calls = []
    get_weather = weather_function_tool(calls)

    def client() -> openai.AsyncOpenAI:  # one per event loop (asyncio.run)
        url = f"http://127.0.0.1:{weather.port}/v1"
        return openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)

    chat = OpenAIChatCompletionsModel(model="local-model", openai_client=client())
    agent = Agent(name="w", instructions="Use the tool.", tools=[get_weather], model=chat)
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert calls == ["Paris"] and result.final_output == ANSWER
    # The SDK's default model: the Responses API.
    agent = Agent(name="w", instructions="Use the tool.", tools=[get_weather], model="local-model")
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client()))
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=3, run_config=config))
    assert calls == ["Paris", "Paris"] and result.final_output == ANSWER


def test_anthropic_tool_runner_runs_the_tool_and_answers(weather):
    calls = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city
        """
        calls.append(city)
        return f"It is sunny in {city}."

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{weather.port}", api_key="x",
                                 max_retries=0)  # fmt: skip
    runner = client.beta.messages.tool_runner(
        model="local-model", max_tokens=100, tools=[get_weather], max_iterations=3,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )  # fmt: skip
    messages = list(runner)
    assert calls == ["Paris"]
    assert [b.type for b in messages[0].content] == ["tool_use"]
    assert messages[-1].content[0].text == ANSWER and messages[-1].stop_reason == "end_turn"


AGENTS = Path(__file__).parents[1] / ".venv" / "agents" / "node_modules" / ".bin"  # make setup


def _cli(name: str, variable: str) -> str | None:
    """An agent CLI: $variable, else make setup's copy, else one on the PATH."""
    installed = AGENTS / name
    return (
        os.environ.get(variable)
        or (str(installed) if installed.exists() else None)
        or (shutil.which(name))
    )


def _codex() -> str | None:
    return _cli("codex", "CODEX_BIN")


@pytest.mark.skipif(_codex() is None, reason="Codex CLI not installed (set CODEX_BIN)")
def test_codex_exec_runs_a_shell_command(tmp_path):
    from bench.codex_cli import run_codex_turn

    folder = scripted(tmp_path / "model", "exec_command", cmd="echo tool-ran")
    flags = ["--model", str(folder), "--served-model-name", "local-model"]
    with running_server(tmp_path, *flags) as server:
        turn = run_codex_turn(f"http://127.0.0.1:{server.port}/v1", "Run echo.", timeout=300,
                              codex=_codex())  # fmt: skip
    assert turn.exit_status == 0, turn.stderr[-2000:]
    assert ANSWER in turn.stdout
    assert "tool-ran" in turn.stdout + turn.stderr  # Codex ran the command and showed it
    assert len(turn.requests) == 2 and turn.all_2xx  # the call, then the result's answer


def _claude() -> str | None:
    return _cli("claude", "CLAUDE_BIN")


@pytest.mark.skipif(_claude() is None, reason="Claude Code not installed (set CLAUDE_BIN)")
def test_claude_code_runs_a_subagent_on_the_small_fast_model(tmp_path):
    """Claude Code with its two models on two of this server's, loaded on demand: the work
    model hands a task to a haiku subagent (its Agent tool), which runs on the other."""
    work = scripted(tmp_path / "work", "Agent", description="greet", prompt="Say hi", model="haiku")
    fast = replying(tmp_path / "fast", "Hi from the fast model.")
    flags = ["--model", f"work={work}", "--model", f"fast={fast}", "--max-sessions", "4"]
    with running_server(tmp_path, *flags) as server:
        assert server.get("/v1/models/fast").json()["state"] == "unloaded"
        env = {
            **os.environ,
            "ANTHROPIC_BASE_URL": server.base_url,
            "ANTHROPIC_API_KEY": "unused",
            "ANTHROPIC_MODEL": "work",
            # Claude Code 2.1 reads the haiku alias from the second; the first is its old name.
            "ANTHROPIC_SMALL_FAST_MODEL": "fast",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": "fast",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "HOME": str(tmp_path),
        }
        argv = [_claude(), "-p", "Greet me through a subagent", "--allowedTools", "Agent"]
        done = subprocess.run(
            [*argv, "--output-format", "json"], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
        result = json.loads(done.stdout)
        assert result["result"] == ANSWER and not result["is_error"]
        assert set(result["modelUsage"]) == {"work", "fast"}  # the subagent ran on `fast`
        states = {m["id"]: m["state"] for m in server.get("/v1/models").json()["data"]}
        assert states == {"work": "loaded", "fast": "loaded"}


def test_message_thread_errors_are_anthropics(weather):
    """A continue that names no live reply, repeats `tools`, or continues a reply twice is
    refused with Anthropic's error codes (the SDK replays the history on them)."""
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{weather.port}", api_key="x",
                                 max_retries=0)  # fmt: skip
    ask = [{"role": "user", "content": "Weather?"}]
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
        "city": {"type": "string"}}}}  # fmt: skip

    def create(**fields):
        return client.messages.create(model="local-model", max_tokens=20, messages=ask,
                                      tools=[tool], extra_body=fields)  # fmt: skip

    first = create(thread={"type": "create"})
    result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id":
               first.content[0].id, "content": "sunny"}]}]  # fmt: skip
    resume = {"type": "continue", "previous_message_id": first.id}
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(
            model="local-model",
            max_tokens=20,
            messages=ask,
            extra_body={"thread": {"type": "continue", "previous_message_id": "msg_gone"}},
        )
    assert e.value.body["error"]["details"] == {"error_code": "thread_not_found"}
    with pytest.raises(anthropic.BadRequestError):  # tools come from the thread
        client.messages.create(model="local-model", max_tokens=20, messages=result,
                               tools=[{"name": "t", "input_schema": {"type": "object"}}],
                               extra_body={"thread": resume})  # fmt: skip
    second = client.messages.create(model="local-model", max_tokens=20, messages=result,
                                    extra_body={"thread": resume})  # fmt: skip
    assert second.content[0].text == ANSWER  # the call was found in the rebuilt history
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(model="local-model", max_tokens=20, messages=result,
                               extra_body={"thread": resume})  # fmt: skip
    assert e.value.status_code == 409
    assert e.value.body["error"]["details"] == {"error_code": "thread_already_continued"}
