"""Stored responses (server/api/responses/store.py) and items as chat-template messages
(server/api/responses/turn.py), without a server: the limits, oldest out without breaking
a chain, the folder a restart or another replica reads, owners; and how calls,
namespaces and reasoning reach the template."""

from __future__ import annotations

import json
import time

import pytest

from server.api.errors import APIError
from server.api.responses.protocol import ResponseCreate
from server.api.responses.store import ResponseStore, StoredResponse, new_response_id
from server.api.responses.turn import messages, responses_turn

DAY = 24 * 3600.0


def _record(text: str, parent: StoredResponse | None = None, owner: str = "", key: str = "k"):
    return StoredResponse(
        id=new_response_id(),
        owner=owner,
        created_at=time.time(),
        session_key=parent.session_key if parent else key,
        parent=parent.id if parent else None,
        input=[{"type": "message", "id": f"in-{text}", "role": "user", "content": []}],
        response={"output": [{"type": "message", "id": f"out-{text}", "role": "assistant"}]},
    )


def _chain(store: ResponseStore, n: int) -> list[StoredResponse]:
    chain = []
    for i in range(n):
        chain.append(_record(str(i), chain[-1] if chain else None))
        store.put(chain[-1])
    return chain


def _ids(items: list[dict]) -> list[str]:
    return [item["id"] for item in items]


def test_the_oldest_goes_out_and_the_chain_keeps_its_history():
    store = ResponseStore(max_count=3, max_bytes=2**30, max_age=DAY)
    chain = _chain(store, 5)
    assert store.get(chain[0].id, "") is None and store.get(chain[1].id, "") is None
    newest = store.get(chain[-1].id, "")
    assert _ids(store.history(newest)) == [f"{d}-{i}" for i in range(5) for d in ("in", "out")]
    assert store.session_key(newest) == "k"  # continuing the newest: the chain's session
    assert store.session_key(store.get(chain[2].id, "")) is None  # a branch: found or new


def test_bytes_and_age_limits():
    one = len(_record("0").encoded())
    store = ResponseStore(max_count=100, max_bytes=int(2.5 * one), max_age=DAY)
    chain = _chain(store, 4)
    assert store.nbytes <= 2.5 * one
    assert _ids(store.history(store.get(chain[-1].id, "")))[:2] == ["in-0", "out-0"]
    aging = ResponseStore(max_count=100, max_bytes=2**30, max_age=60)
    old = _record("old")
    old.created_at -= 120
    aging.put(old)
    assert aging.get(old.id, "") is None


def test_delete_owners_and_ids_that_are_not_ours():
    store = ResponseStore(max_count=10, max_bytes=2**30, max_age=DAY)
    mine = _record("a", owner="alice")
    store.put(mine)
    assert store.get(mine.id, "bob") is None and not store.delete(mine.id, "bob")
    assert store.get("../../etc/passwd", "alice") is None
    child = _record("b", mine, owner="alice")
    store.put(child)
    assert store.delete(mine.id, "alice") and store.get(mine.id, "alice") is None
    assert _ids(store.history(child)) == ["in-a", "out-a", "in-b", "out-b"]


def test_the_folder_is_read_back_and_followed(tmp_path):
    first = ResponseStore(max_count=10, max_bytes=2**30, max_age=DAY, folder=tmp_path)
    chain = _chain(first, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r.id}.json" for r in chain)
    again = ResponseStore(max_count=10, max_bytes=2**30, max_age=DAY, folder=tmp_path)  # restart
    newest = again.get(chain[-1].id, "")
    assert _ids(again.history(newest)) == _ids(first.history(chain[-1]))
    assert again.session_key(newest) == "k"
    later = _record("3", chain[-1])  # another replica writes a turn
    first.put(later)
    assert _ids(again.history(again.get(later.id, "")))[-1] == "out-3"
    first.delete(later.id, "")  # and deletes it
    assert again.get(later.id, "") is None
    (tmp_path / "resp_0123.json").write_text("{not json")
    assert ResponseStore(10, 2**30, DAY, folder=tmp_path).get(chain[0].id, "") is not None


# ------------------------------------------------------------------ items -> messages


def _turn(history: list[dict], *items: dict, **fields):
    body = ResponseCreate.model_validate({"model": "m", "input": list(items), **fields})
    return responses_turn(body, history, None, "")


def test_calls_join_their_reply_and_reasoning_goes_beside_it():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
            {"type": "reasoning_text", "text": "use the tool"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "close", "namespace": "agents",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "ok"}]},
    ]  # fmt: skip
    out = _turn([], *items, instructions="Sys.").turn.messages
    assert [m["role"] for m in out] == ["system", "system", "user", "assistant", "tool", "tool"]
    reply = out[3]
    assert reply["content"] == "Checking." and reply["reasoning_content"] == "use the tool"
    names = [c["function"]["name"] for c in reply["tool_calls"]]
    assert names == ["get", "agents.close"]
    assert reply["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert out[5] == {"role": "tool", "tool_call_id": "c2", "content": "ok"}


def test_tools_offered_and_left_out():
    tools = [
        {"type": "function", "name": "get", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "agents", "description": "d", "tools": [
            {"type": "function", "name": "close"}, {"type": "custom", "name": "patch"}]},
        {"type": "web_search"},
        {"type": "mcp", "server_label": "files"},
        {"type": "custom", "name": "exec"},
    ]  # fmt: skip
    built = _turn([], {"role": "user", "content": "hi"}, tools=tools)
    assert [f.name for f in built.turn.functions] == ["get", "agents.close"]
    assert built.offered.names["agents.close"] == ("agents", "close")
    left_out = ["agents.custom:patch", "web_search", "mcp:files", "custom:exec"]
    assert built.offered.left_out == left_out
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "get"}]}  # fmt: skip
    narrowed = _turn([], {"role": "user", "content": "hi"}, tools=tools, tool_choice=allowed)
    assert [f.name for f in narrowed.turn.functions] == ["get"]
    assert narrowed.turn.tool_choice == "required"


def test_history_references_and_unknown_calls():
    history = [
        {"type": "message", "id": "msg_a", "role": "user", "content": [
            {"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "id": "fc_a", "call_id": "c1", "name": "get", "arguments": "{}"},
    ]  # fmt: skip
    built = _turn(history, {"type": "item_reference", "id": "msg_a"})
    assert [m["content"] for m in built.turn.messages][-1] == "hi"
    assert built.items[0].id == "msg_a"
    answered = _turn(history, {"type": "function_call_output", "call_id": "c1", "output": "x"})
    assert answered.turn.messages[-1]["role"] == "tool"
    for bad in (
        {"type": "function_call_output", "call_id": "c9", "output": "x"},
        {"type": "item_reference", "id": "msg_zzz"},
    ):
        with pytest.raises(APIError) as e:
            _turn(history, bad)
        assert e.value.status == 400 and e.value.param.startswith("input[0]")
    assert json.dumps(messages(None, [], 0)) == "[]"
