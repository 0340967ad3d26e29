"""Bad input gets a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

import pytest
from server_harness import MODEL

OK = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
CASES = {
    "malformed json": b'{"model": "x", "messages": [',
    "not an object": b"[1, 2, 3]",
    "wrong types": {**OK, "temperature": "hot", "max_tokens": "many"},
    "empty messages": {**OK, "messages": []},
    "unknown role": {**OK, "messages": [{"role": "wizard", "content": "hi"}]},
    "negative max_tokens": {**OK, "max_tokens": -5},
    "huge max_tokens": {**OK, "max_tokens": 10**9},
    "unknown model": {**OK, "model": "gpt-9"},
    "bad session id": {**OK, "prompt_cache_key": "../../etc/passwd"},
    "invalid utf-8": b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", '
    b'"content": "\xff\xfe"}]}',
    "bad stop": {**OK, "stop": ["a", "b", "c", "d", "e"]},
    "bad kv_cache": {**OK, "kv_cache": {"max_kv": 10**9}},
    "logit_bias out of vocab": {**OK, "logit_bias": {"99999999": 5}},
    "logit_bias out of range": {**OK, "logit_bias": {"5": 500}},
    "unknown kv policy": {**OK, "kv_cache": {"policy": "lru"}},
    "unknown kvarn bits": {**OK, "kv_cache": {"policy": "kvarn", "kvarn": "k3v1"}},
    "lone surrogate": b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", '
    b'"content": "a\\ud800b"}]}',
    "image content": {
        **OK,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_openai_error(api, case):
    r = api.post("/v1/chat/completions", CASES[case])
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "path,body,named",
    [
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
            b'"text": "\\udc00"}]}], "max_tokens": 2}',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", b'{"model": "%s", "prompt": "x\\ud83d", "max_tokens": 2}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(api, path, body, named):
    """JSON's \\ud800-\\udfff escapes, unpaired, decode to no text (UTF-8 and the
    tokenizer refuse it): a 400 that says where, not a template failure."""
    r = api.post(path, body.replace(b"%s", MODEL.encode()))
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"] and "surrogate" in r.json()["error"]["message"]
    paired = body.replace(b"%s", MODEL.encode()).replace(b"\\udc00", b"\\ud83d\\ude00")
    assert api.post(path, paired.replace(b"x\\ud83d", b"x\\ud83d\\ude00")).status_code == 200


def test_odd_keys_depth_and_tool_arguments_are_a_400_or_ignored_never_a_500(api):
    """A surrogate in a key (the message names it, escaped), in the JSON text of an
    earlier call's arguments (decoded only when the template renders it), and a body
    nested as deep as the JSON parser takes."""
    body = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi",'
    key = api.post("/v1/chat/completions", (body + b' "\\ud800": 1}]}') % MODEL.encode())
    assert key.status_code == 400 and "surrogate" in key.json()["error"]["message"], key.text
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": "\\ud800"}'},
    }
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    args = api.post("/v1/chat/completions", {**OK, "messages": history})
    assert args.status_code == 400 and "arguments" in args.json()["error"]["message"], args.text
    for depth in (500, 900, 2000):
        deep = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
        deep += b'"extra": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
        r = api.post("/v1/chat/completions", deep % MODEL.encode())
        assert r.status_code < 500, (depth, r.text)


def test_bad_session_header(api):
    r = api.post("/v1/chat/completions", OK, headers={"X-Session-ID": "a b/c"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"


def test_full_policy_rejects_a_prompt_longer_than_its_context(api):
    long = {"role": "user", "content": "word " * 400}
    body = {**OK, "messages": [long], "kv_cache": {"policy": "full", "max_kv": 128}}
    r = api.post("/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_route_and_method(api):
    assert api.get("/v1/nothing").status_code == 404
    assert api.get("/v1/nothing").json()["error"]["type"]
    assert api.get("/v1/chat/completions").status_code == 405


def test_server_still_healthy_after_bad_input(api):
    r = api.post("/v1/chat/completions", OK)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
