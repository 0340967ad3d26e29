"""Client libraries as their docs use them, against the server on the default model:
instructor (TOOLS mode, partial and iterable), the OpenAI Agents SDK (chat-completions
model, and its default Responses model: a function tool, an output type, tool_choice
required then reset), pydantic-ai
(NativeOutput beside a tool) and langchain's with_structured_output.

The model is 135M parameters: what is asserted is the shape each library needs (its
parsing succeeds, the types hold, the tool is called), not the quality of the answers.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel
from server_harness import MODEL

pytestmark = pytest.mark.slow(seconds=60)


class City(BaseModel):
    name: str
    country: str


PARIS = [{"role": "user", "content": "Paris is a city in which country? Name and country."}]


def test_instructor_create_partial_and_iterable_in_tools_mode(api):
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0),
        mode=instructor.Mode.TOOLS,
    )
    kwargs = dict(model=MODEL, max_tokens=60, temperature=0, max_retries=0)
    partials = list(
        client.chat.completions.create_partial(response_model=City, messages=PARIS, **kwargs)
    )
    assert len(partials) > 2  # it streamed: the object grew chunk by chunk
    final = City.model_validate(partials[-1].model_dump())
    assert final.name and final.country
    europe = [{"role": "user", "content": "Name two cities in Europe with their countries."}]
    cities = list(
        client.chat.completions.create_iterable(response_model=City, messages=europe, **kwargs)
    )
    assert cities and all(isinstance(c, City) and c.name for c in cities)


def _weather_agent(model) -> tuple:
    """The OpenAI Agents SDK's agent with one function tool, a typed output and a forced
    first call, on `model`; the list its tool's calls land in."""
    from agents import Agent, ModelSettings
    from weather_tool import weather_function_tool

    calls = []
    get_weather = weather_function_tool(calls)
    agent = Agent(
        name="weather",
        instructions="Answer with the city.",
        tools=[get_weather],
        output_type=City,
        model=model,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )
    return agent, calls


def test_openai_agents_sdk_calls_the_tool_then_answers_in_its_type(api):
    from agents import OpenAIChatCompletionsModel, Runner

    client = openai.AsyncOpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)
    agent, calls = _weather_agent(OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls  # the forced first turn called it; reset to auto, the next answered
    assert isinstance(result.final_output, City)


def test_openai_agents_sdk_default_responses_model_runs_a_tool_to_its_final_output(api):
    from agents import OpenAIProvider, RunConfig, Runner

    client = openai.AsyncOpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)
    agent, calls = _weather_agent(MODEL)  # a name: the provider's default, the Responses API
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
    result = asyncio.run(
        Runner.run(agent, "What is the weather in Paris?", max_turns=4, run_config=config)
    )
    assert calls  # the forced first turn called it; reset to auto, the next answered
    assert isinstance(result.final_output, City)
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)


def test_pydantic_ai_native_output_beside_a_tool(api):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=api.base_url + "/v1", api_key="unused")
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=NativeOutput(City))

    @agent.tool_plain
    def weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    result = agent.run_sync(
        "Which city is the Eiffel tower in?", model_settings={"temperature": 0, "max_tokens": 80}
    )
    assert isinstance(result.output, City) and result.output.name


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(api, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=api.base_url + "/v1", api_key="unused", temperature=0, max_tokens=60
    )
    out = llm.with_structured_output(City, method=method).invoke(PARIS[0]["content"])
    assert isinstance(out, City) and out.name and out.country
