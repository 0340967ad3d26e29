"""Message threads' store (server/api/messages/threads.py) without a server: a reply is
continued once, by its own caller, within the TTL; the errors carry Anthropic's codes,
which the anthropic SDK replays the whole history on."""

from __future__ import annotations

import pytest

from server.api.errors import APIError
from server.api.messages.threads import ThreadStore, ThreadTurn


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(owner: str = "a") -> ThreadTurn:
    return ThreadTurn("sys", [], [{"role": "user", "content": "hi"}], owner, "s1", 0.0)


def code_of(store: ThreadStore, previous: str, owner: str = "a") -> tuple[int, str]:
    with pytest.raises(APIError) as e:
        store.resume(previous, owner)
    assert e.value.details == {"error_code": e.value.code}
    return e.value.status, e.value.code


def test_a_reply_is_continued_once_by_its_caller():
    store = ThreadStore(clock=Clock())
    store.keep("msg_1", turn(), None)
    assert code_of(store, "msg_1", owner="b") == (404, "thread_not_found")
    held = store.resume("msg_1", "a")
    assert held.messages[0]["content"] == "hi" and held.session == "s1"
    assert code_of(store, "msg_1") == (409, "thread_continue_in_flight")
    store.release("msg_1")  # the continue failed: it may be tried again
    store.resume("msg_1", "a")
    store.keep("msg_2", turn(), "msg_1")
    assert code_of(store, "msg_1") == (409, "thread_already_continued")
    assert store.resume("msg_2", "a").system == "sys"


def test_threads_expire_and_the_oldest_go_first():
    clock = Clock()
    store = ThreadStore(ttl=300, capacity=2, clock=clock)
    store.keep("old", turn(), None)
    clock.now = 10
    store.keep("mid", turn(), None)
    clock.now = 20
    store.keep("new", turn(), None)  # over capacity: the least recently used leaves
    assert code_of(store, "old") == (404, "thread_not_found")
    clock.now = 20 + 301
    assert code_of(store, "new") == (404, "thread_not_found")
    assert code_of(store, "unknown") == (404, "thread_not_found")
