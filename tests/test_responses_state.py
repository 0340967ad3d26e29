"""A previous_response_id chain across a restart with --spill-dir (its history on disk, its
cache spilled and restored), and under --session-scope caller (an id is its owner's)."""

from __future__ import annotations

import openai
import pytest
from server_harness import MODEL, launch
from test_responses import SHORT

from bench.local_server import stop_server

pytestmark = pytest.mark.slow(seconds=40)
KEYS = "alice-key,bob-key"


def _flags(spill) -> list[str]:
    return ["--kv-budget", "128MiB", "--spill-dir", str(spill), "--api-key", KEYS,
            "--session-scope", "caller"]  # fmt: skip


def test_a_chain_continues_with_its_cache_after_a_restart(tmp_path):
    spill = tmp_path / "spill"
    server = launch(tmp_path, *_flags(spill))
    try:
        alice = server.client
        bob = openai.OpenAI(base_url=server.base_url + "/v1", api_key="bob-key", max_retries=0)
        first = alice.responses.create(input="Say hi", **SHORT)
        second = alice.responses.create(input="Again", previous_response_id=first.id, **SHORT)
        # another caller sees none of it
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(second.id)
        with pytest.raises(openai.BadRequestError) as e:
            bob.responses.create(input="Mine?", previous_response_id=second.id, **SHORT)
        assert e.value.body["code"] == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(second.id)
    finally:
        stop_server(server.process)  # spills the sessions
    assert (spill / "responses" / f"{second.id}.json").exists()
    server = launch(tmp_path, *_flags(spill))
    try:
        alice = server.client
        assert alice.responses.retrieve(second.id).output_text == second.output_text
        third = alice.responses.create(input="More", previous_response_id=second.id, **SHORT)
        cached = third.usage.input_tokens_details.cached_tokens
        assert cached >= second.usage.input_tokens  # the cache came back from the spill folder
        assert "restored" in server.log_text()
        items = alice.responses.input_items.list(third.id, order="asc").data
        assert [i.content[0].text for i in items if i.role == "user"] == ["Say hi", "Again", "More"]
        assert MODEL == third.model
    finally:
        stop_server(server.process)
