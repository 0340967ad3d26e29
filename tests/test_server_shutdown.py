"""SIGTERM with streams open: bounded exit, an error event on every stream, sessions spilled,
and a restart that carries every conversation on; a second signal exits at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from server_harness import MODEL, launch, sse_events

pytestmark = pytest.mark.slow(seconds=30)

NAMES = ("Alice", "Bruno", "Chiara", "Dmitri")
GRACE = 1.0  # --shutdown-timeout
EXIT_BOUND = GRACE + 6.0  # the drain, then spilling 8 small sessions and exiting
# SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>: a greedy story can end within the
# grace period otherwise, and then no stream is left to cut.
NO_END = {"0": -100, "1": -100, "2": -100}


def chat(api, messages, key, max_tokens):
    r = api.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"prompt_cache_key": key},
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


class OpenStream(threading.Thread):
    """A streamed turn read on its own thread: its events, until the server ends it."""

    def __init__(self, api, messages, key):
        super().__init__(daemon=True)
        self.body = {"model": MODEL, "messages": messages, "max_tokens": 2000, "stream": True}
        self.body |= {"temperature": 0, "prompt_cache_key": key, "logit_bias": NO_END}
        self.api, self.events, self.ended = api, [], threading.Event()

    def run(self):
        conn, response = self.api.open_request(self.body)
        try:
            for event in sse_events(response):
                self.events.append(event)
        finally:
            conn.close()
            self.ended.set()

    def content_chunks(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and e.get("choices"))


def conversations(api):
    """Turn 1 of four conversations, and what turn 2 gives when nobody interrupts it (short
    greedy replies: 6 tokens of greeting, 8 of turn 2, compared whole after the restart)."""
    histories, uninterrupted = {}, {}
    for i, name in enumerate(NAMES):
        messages = [{"role": "user", "content": f"My name is {name}. Please greet me."}]
        reply, _ = chat(api, messages, f"conv-{i}", 6)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Now tell me a long story about myself."},
        ]
        histories[f"conv-{i}"] = messages
        chat(api, messages[:1], f"ref-{i}", 6)  # the same two turns, never cut
        uninterrupted[f"conv-{i}"] = chat(api, messages, f"ref-{i}", 8)[0]
    return histories, uninterrupted


def test_sigterm_cuts_streams_with_an_error_spills_and_a_restart_restores(tmp_path):
    spill = tmp_path / "spill"
    flags = ["--spill-dir", str(spill), "--kv-budget", "256MiB", "--max-sessions", "8"]
    first = launch(tmp_path, *flags, "--shutdown-timeout", str(GRACE))
    try:
        histories, uninterrupted = conversations(first)
        streams = [OpenStream(first, h, key) for key, h in histories.items()]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while min(s.content_chunks() for s in streams) < 3:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        sent = time.monotonic()
        first.process.send_signal(signal.SIGTERM)
        first.process.wait(timeout=EXIT_BOUND + 10)
        took = time.monotonic() - sent
    finally:
        if first.process.poll() is None:
            first.process.kill()
    assert took < EXIT_BOUND, took
    for s in streams:
        assert s.ended.wait(5)
        *_, last, done = s.events
        assert done == "[DONE]"
        assert "error" in last, json.dumps(s.events[-3:])
        assert last["error"]["code"] == "server_shutting_down", last
        assert not any(c["choices"][0]["finish_reason"] for c in s.events[1:-2])
    log = first.log_text()
    assert log.count("cut by the shutdown") == 4 and "drained; 8 session(s) spilled" in log
    assert sorted(p.stem for p in spill.glob("*.safetensors")) == sorted(
        [*histories, *(f"ref-{i}" for i in range(4))]
    )
    assert not any((spill / ".partial").iterdir())

    second = launch(tmp_path, *flags, "--shutdown-timeout", "60")
    try:
        sessions = second.sessions()
        assert all(sessions[key]["spilled"] for key in histories)
        for key, messages in histories.items():  # the client retries the turn that was cut
            reply, cached = chat(second, messages, key, 8)
            assert cached > 0
            assert reply == uninterrupted[key], key
        assert second.metrics()["h2o_sessions_restored_total"] == 4

        # A second signal does not wait for the drain (60 s here).
        stream = OpenStream(second, histories["conv-0"], "conv-0")
        stream.start()
        second.wait_for(lambda m: m["h2o_active_generations"] == 1, what="a generation")
        second.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert second.process.poll() is None  # draining
        sent = time.monotonic()
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=5) == 128 + signal.SIGTERM
        assert time.monotonic() - sent < 2
        assert "second SIGTERM, exiting without draining" in second.log_text()
    finally:
        if second.process.poll() is None:
            second.process.kill()
