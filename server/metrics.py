"""Server counters and gauges, rendered as Prometheus text (GET /metrics)."""

from __future__ import annotations

import threading
from collections import Counter

COUNTERS = {
    "requests_total": "requests accepted for generation",
    "requests_failed_total": "requests that ended in an error",
    "requests_cancelled_total": "requests stopped because the client went away",
    "requests_rejected_total": "requests refused because the queue was full",
    "prompt_tokens_total": "prompt tokens of finished requests",
    "cached_prompt_tokens_total": "prompt tokens reused from a session cache",
    "completion_tokens_total": "tokens generated",
    "decode_seconds_total": "seconds spent in decode steps",
    "prefill_tokens_total": "prompt tokens run through the model",
    "sessions_spilled_total": "sessions written to disk to free memory",
    "sessions_restored_total": "spilled sessions loaded back",
    "sessions_dropped_total": "sessions dropped to free memory",
    "sessions_rebuilt_total": "sessions rebuilt because a rewind crossed an eviction",
}


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self.gauges: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        assert name in COUNTERS, name
        with self._lock:
            self._counts[name] += value

    def get(self, name: str) -> float:
        with self._lock:
            return self._counts[name]

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        lines = []
        with self._lock:
            counts = dict(self._counts)
        for name, help_text in COUNTERS.items():
            lines += [
                f"# HELP h2o_{name} {help_text}",
                f"# TYPE h2o_{name} counter",
                f"h2o_{name} {counts.get(name, 0):g}",
            ]
        for name, (value, help_text) in gauges.items():
            lines += [
                f"# HELP h2o_{name} {help_text}",
                f"# TYPE h2o_{name} gauge",
                f"h2o_{name} {value:g}",
            ]
        return "\n".join(lines) + "\n"
