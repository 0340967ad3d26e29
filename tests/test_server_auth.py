"""API keys, CORS and sessions scoped to their caller, on a server started with all three."""

from __future__ import annotations

import pytest
from server_harness import MODEL, running_server

ORIGIN = "http://chat-ui.example"
KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    flags = ["--api-key", ",".join(KEYS), "--allowed-origins", ORIGIN]
    flags += ["--session-scope", "caller", "--max-sessions", "4", "--kv-budget", "256MiB"]
    with running_server(tmp_path_factory.mktemp("auth"), *flags) as api:
        yield api


def as_key(key: str, **headers) -> dict:
    return {"Authorization": f"Bearer {key}", **headers}


def chat(api, key: str, cache_key: str | None, user: str | None = None):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there, friend."}]}
    body |= {"max_tokens": 4, "temperature": 0}
    if cache_key:
        body["prompt_cache_key"] = cache_key
    if user:
        body["user"] = user
    r = api.request("POST", "/v1/chat/completions", body, as_key(key))
    assert r.status_code == 200, r.text
    return r.json()


def listed(api, key: str, user: str | None = None) -> set[str]:
    path = "/v1/sessions" + (f"?user={user}" if user else "")
    return {s["id"] for s in api.request("GET", path, None, as_key(key)).json()["data"]}


def test_a_preflight_with_a_key_set_gets_the_cors_headers(guarded):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    no_key = {"Authorization": None}
    r = guarded.request("OPTIONS", "/v1/chat/completions", None, no_key | preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # an answer the browser can read: a 401 carries the CORS headers too
    denied = guarded.request("GET", "/v1/models", None, {"Authorization": "", "Origin": ORIGIN})
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == ORIGIN
    ok = guarded.request("GET", "/v1/models", None, as_key(KEYS[0], Origin=ORIGIN))
    exposed = ok.headers["access-control-expose-headers"].lower()
    assert ok.status_code == 200 and "x-session-id" in exposed


@pytest.mark.parametrize(
    "authorization",
    [KEYS[0], f"Basic {KEYS[0]}", "Bearer", "Bearer ", f"Bearer {KEYS[0]}x", f"Bearer {KEYS[0]} x"],
)
def test_only_a_bearer_key_is_accepted(guarded, authorization):
    r = guarded.request("GET", "/v1/models", None, {"Authorization": authorization})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_every_listed_key_and_the_scheme_in_any_case_work(guarded):
    for authorization in (f"Bearer {KEYS[0]}", f"bearer {KEYS[1]}", f"BEARER  {KEYS[0]} "):
        r = guarded.request("GET", "/v1/models", None, {"Authorization": authorization})
        assert r.status_code == 200, authorization


def test_docs_schema_and_metrics_need_the_key_health_does_not(guarded):
    for path in ("/docs", "/openapi.json", "/redoc", "/metrics", "/v1/sessions"):
        assert guarded.request("GET", path, None, {"Authorization": None}).status_code == 401, path
        assert guarded.request("GET", path, None, as_key(KEYS[1])).status_code == 200, path
    assert guarded.request("GET", "/health", None, {"Authorization": None}).status_code == 200


def test_sessions_are_scoped_to_the_key(guarded):
    one, two = KEYS
    first = chat(guarded, one, "shared-name")
    assert "shared-name" in listed(guarded, one) and "shared-name" not in listed(guarded, two)
    r = guarded.request("DELETE", "/v1/sessions/shared-name", None, as_key(two))
    assert r.status_code == 404  # not theirs to delete
    # the same key name under another API key is another conversation: nothing reused
    other = chat(guarded, two, "shared-name")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = chat(guarded, one, "shared-name")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]
    # anonymous sessions are found by prefix only among the caller's own
    chat(guarded, one, None)
    assert chat(guarded, two, None)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for key in KEYS:
        r = guarded.request("DELETE", "/v1/sessions/shared-name", None, as_key(key))
        assert r.status_code == 200


def test_sessions_are_scoped_to_the_user_within_a_key(guarded):
    key = KEYS[0]
    chat(guarded, key, "diary", user="alice")
    assert "diary" in listed(guarded, key, "alice")
    assert "diary" not in listed(guarded, key, "bob") and "diary" not in listed(guarded, key)
    bob = chat(guarded, key, "diary", user="bob")
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
