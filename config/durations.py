"""Durations as Ollama writes them ("5m", "1h30m", "90s", or seconds): a request's
`keep_alive` and a models file's `ttl` (server/engine/catalog.py)."""

from __future__ import annotations

import re
from typing import Any

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's keep_alive as seconds: a number, or a duration ("5m", "1h30m", "90s");
    negative: for ever; 0: unload once the request is done."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("keep_alive is seconds (a number) or a duration such as '5m'")
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive {value!r} is not seconds or a duration such as '5m'")
    return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
