"""A client that goes away stops its generation at once, streaming or not (no silence needed)."""

from __future__ import annotations

import json
import re
import socket

import pytest
from server_harness import MODEL

ESSAY = [{"role": "user", "content": "Write a very long essay about rivers and mountains."}]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_dropped_client_frees_its_slot_within_two_steps(api, stream):
    before = api.metrics()
    body = {"model": MODEL, "messages": ESSAY, "max_tokens": 2000, "stream": stream}
    body["temperature"] = 0  # greedy: a long reply, never an early end-of-sequence
    conn = api.connection()
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    decoding = api.wait_for(
        lambda m: m["h2o_decoded_tokens_total"] >= before["h2o_decoded_tokens_total"] + 8,
        what="decoding to start",
    )
    assert decoding["h2o_active_generations"] == 1
    at_close = api.metrics()["h2o_decoded_tokens_total"]
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client gives up (an SDK timeout, a closed tab)
    conn.close()
    after = api.wait_for(lambda m: m["h2o_active_generations"] == 0, 30, "the slot to free")
    assert after["h2o_decoded_tokens_total"] - at_close <= 2
    assert after["h2o_requests_cancelled_total"] == before["h2o_requests_cancelled_total"] + 1
    assert after["h2o_completion_tokens_total"] == before["h2o_completion_tokens_total"]
    # logged, with why and how far it got (sse-starlette may see the disconnect first)
    logged = r"cancelled \((client disconnected|response closed)\) after \d+ tokens"
    assert re.search(logged, api.log_text())
    # the server keeps serving
    r = api.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert r.choices[0].message.content
