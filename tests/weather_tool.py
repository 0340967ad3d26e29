"""The OpenAI Agents SDK function tool the client tests give their agents."""

from __future__ import annotations


def weather_function_tool(calls: list):
    """`get_weather(city)`, recording each city it is called with in `calls`."""
    from agents import function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    return get_weather
