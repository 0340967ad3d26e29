"""The chat page in headless Chromium against the real server (default model, API key, CORS).

Chromium comes from Debian's packages (`make setup` installs it as root); Playwright
only drives it. Without it the test is skipped with the reason.
"""

from __future__ import annotations

import pytest
from server_harness import API_KEY

from bench.ui_browser import ChatPage, browser_page, missing_browser
from bench.ui_screenshots import essay_excerpt

pytestmark = pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser()))


@pytest.fixture
def ui(keyed_api):
    """The page with its key entered; fails the test on a script error or an outside request."""
    outside, errors = [], []
    with browser_page() as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on(
            "request",
            lambda r: None if r.url.startswith(keyed_api.base_url) else outside.append(r.url),
        )
        chat = ChatPage(page, keyed_api.base_url)
        chat.open()
        chat.enter_key(API_KEY)  # the server needs one: the page asks for it
        yield chat
    assert not errors, errors
    assert not outside, f"the page fetched from elsewhere: {outside}"


def test_streamed_reply_and_stop(ui, keyed_api):
    page = ui.page
    ui.new_chat(max_tokens=48)
    ui.type_message("Write a short poem about the sea.")
    # Text shows up while the reply is still streaming.
    page.wait_for_selector(".message.assistant.streaming .content:not(:empty)")
    assert page.is_visible("#stop")
    assert ui.wait_reply().strip()
    assert "tokens" in page.locator(".message.assistant .meta").last.inner_text()

    # Esc stops a long reply: the page aborts the request, the server cancels the generation.
    ui.new_chat(max_tokens=2000)
    page.focus("#composer-input")
    page.keyboard.type("Tell me a very long story about a lighthouse keeper.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".message.assistant.streaming .content:not(:empty)")
    page.keyboard.press("Escape")
    page.wait_for_selector("#stop", state="hidden", timeout=5000)
    assert page.locator(".message.assistant .meta").last.inner_text().startswith("stopped")
    key = ui.current_id()
    page.wait_for_timeout(1500)  # the server notices the disconnect within a step
    session = keyed_api.sessions()[key]
    assert not session["busy"]
    (turn,) = keyed_api.get(f"/v1/sessions/{key}/cache").json()["turns"]
    assert 0 < turn["usage"]["completion_tokens"] < 2000


def test_cache_view_marks_evictions(ui, keyed_api):
    page = ui.page
    ui.new_chat(policy="h2o", max_kv=64, max_tokens=16)
    ui.type_message(f"{essay_excerpt()}\n\nWho wrote this? Answer in one sentence.")
    ui.wait_reply()
    key = ui.current_id()

    page.focus("#tab-chat")
    page.keyboard.press("ArrowRight")  # tabs move with the arrow keys
    page.wait_for_selector("#cache-view[data-state='loaded'] #fig-logical_tokens")
    figures, session = ui.figures(), keyed_api.sessions()[key]
    assert session["max_kv"] == 64 and session["evictions"] > 0
    for name in ("logical_tokens", "stored_tokens", "evictions", "bytes"):
        assert int(figures[name]) == session[name], name
    assert figures["policy"] == "h2o"

    report = keyed_api.get(f"/v1/sessions/{key}/cache").json()
    n = session["logical_tokens"]
    assert page.locator("#tokens .tok").count() == n
    gone = report["tokens"]["held"].count(0)
    assert gone > 0 and page.locator("#tokens .tok.evicted").count() == gone
    assert int(figures["evicted_everywhere"]) == gone
    assert page.locator("#tokens .tok.seg-sink").count() == report["segments"]["sink"]
    assert page.locator("#tokens .tok.seg-recent").count() == report["segments"]["recent"]
    assert page.locator("#tokens .tok.seg-heavy").count() > 0

    page.hover("#tokens .tok.evicted >> nth=0")
    assert "held by 0 of 90" in page.inner_text("#token-detail")
    page.focus("#tokens")
    page.keyboard.press("End")
    assert f"position {n - 1:,}" in page.inner_text("#token-detail")
    assert page.locator("#turns tbody tr").count() == 1

    # A narrow window: nothing overflows sideways; the conversation list opens as a drawer.
    page.set_viewport_size({"width": 380, "height": 760})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert not page.is_visible("#sidebar")
    page.click("#toggle-sidebar")
    assert page.is_visible(f".conv[data-id='{key}']")
