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
    "decoded_tokens_total": "tokens decoded, for finished and cancelled requests alike",
    "prefill_tokens_total": "prompt tokens run through the model",
    "decode_passes_total": "decode forward passes (a speculative one verifies several tokens)",
    "draft_tokens_total": "tokens proposed by speculative drafts",
    "accepted_draft_tokens_total": "drafted tokens the model took",
}
# Per model served (labelled `model`), loaded or not.
MODEL_GAUGES = {
    "loaded": "1 while the model is in memory, else 0",
    "weight_bytes": "bytes of its parameters while loaded",
    "cache_bytes": "bytes held by its conversations' KV caches",
    "sessions": "its conversations in memory",
}
# Counted by the session store (server/sessions/store.py, SessionStore.counts).
SESSION_COUNTERS = {
    "spilled": "sessions written to disk (memory, idle time, handover, shutdown)",
    "restored": "spilled sessions loaded back",
    "dropped": "sessions dropped to free memory",
    "rebuilt": "sessions rebuilt because a rewind crossed an eviction",
    "refused": "spill files refused on restore (corrupt or of another model)",
    "handed_over": "sessions spilled because another replica asked for them",
    "borrowed": "turns served with a throwaway cache: another replica kept the session",
    "prefix_hits": "conversations started from a stored system prompt (prefix store)",
    "prefix_tokens": "prompt tokens served from the prefix store instead of prefilled",
}


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, value: float = 1) -> None:
        assert name in COUNTERS, name
        with self._lock:
            self._counts[name] += value

    def get(self, name: str) -> float:
        with self._lock:
            return self._counts[name]

    def render(
        self, session_counts: dict[str, int], sessions: list[dict], queue_depth: int, active: int,
        budget: int, prefixes: dict, mlx_active: int = 0, models: dict[str, dict] | None = None,
        memory: tuple[int, int] = (0, 0),
    ) -> str:  # fmt: skip
        """Prometheus text: every counter, then gauges from the session stores' snapshots,
        then per model (`models`: {name: MODEL_GAUGES' values}) gauges labelled by model.
        `memory`: (--memory-budget, what the loaded models hold under it)."""
        with self._lock:
            counts = dict(self._counts)
        lines: list[str] = []
        for name, help_text in COUNTERS.items():
            lines += _metric(name, "counter", help_text, counts.get(name, 0))
        for event, help_text in SESSION_COUNTERS.items():
            lines += _metric(
                f"sessions_{event}_total", "counter", help_text, session_counts.get(event, 0)
            )
        resident = [s for s in sessions if not s["spilled"]]
        seconds = counts.get("decode_seconds_total", 0)
        gauges = {
            "queue_depth": (queue_depth, "requests waiting to start"),
            "active_generations": (active, "requests being generated"),
            "sessions": (len(resident), "sessions in memory"),
            "sessions_spilled": (len(sessions) - len(resident), "sessions on disk"),
            "cache_bytes": (sum(s["bytes"] for s in resident), "bytes held by KV caches"),
            "cache_budget_bytes": (
                budget,
                "KV memory budget (sessions and prefix store) of the loaded models",
            ),
            "models_loaded": (
                sum(m["loaded"] for m in (models or {}).values()),
                "models in memory",
            ),
            "memory_budget_bytes": (memory[0], "--memory-budget (0: none)"),
            "memory_in_use_bytes": (
                memory[1],
                "the loaded models' weights and KV shares, counted against --memory-budget",
            ),
            "mlx_active_memory_bytes": (mlx_active, "bytes MLX holds: weights, caches, buffers"),
            "prefix_store_bytes": (prefixes["bytes"], "bytes held by stored system prompts"),
            "prefix_store_entries": (
                prefixes["entries"],
                "system prompts stored for new conversations",
            ),
            "evicted_tokens": (
                sum(s["evictions"] for s in sessions),
                "tokens evicted, live sessions",
            ),
            "decode_tokens_per_second": (
                counts.get("completion_tokens_total", 0) / seconds if seconds else 0.0,
                "completion tokens per second of decode time, since start",
            ),
        }
        for name, (value, help_text) in gauges.items():
            lines += _metric(name, "gauge", help_text, value)
        for name, help_text in MODEL_GAUGES.items():
            lines += [f"# HELP h2o_model_{name} {help_text}", f"# TYPE h2o_model_{name} gauge"]
            for model, values in (models or {}).items():
                label = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
                lines.append(f'h2o_model_{name}{{model="{label}"}} {_number(values[name])}')
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str, value: float) -> list[str]:
    return [
        f"# HELP h2o_{name} {help_text}",
        f"# TYPE h2o_{name} {kind}",
        f"h2o_{name} {_number(value)}",
    ]


def _number(value: float) -> str:
    """Counts and bytes exact (`:g` keeps 6 digits: 41943040 read back as 41943000)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
