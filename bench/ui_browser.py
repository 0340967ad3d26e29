"""The chat page in a real browser: Debian's headless Chromium driven by Playwright.

Used by the browser test (tests/test_ui_browser.py) and the screenshots in docs/ui.md
(bench/ui_screenshots.py). Playwright only drives the system's Chromium; nothing
downloads a browser (never run `playwright install` for this).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    """The system Chromium (`apt-get install chromium`), or None."""
    if Path(CHROMIUM).exists():
        return CHROMIUM
    return shutil.which("chromium")


def missing_browser() -> str | None:
    """Why the browser cannot run here, or None when it can."""
    if chromium_path() is None:
        return "needs Debian's chromium (make setup installs it as root: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "needs Playwright for Python (pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def browser_page(width: int = 1280, height: int = 800, scale: float = 1) -> Iterator:
    """A Playwright page in a fresh headless Chromium profile, closed afterwards."""
    from playwright.sync_api import sync_playwright

    with (
        tempfile.TemporaryDirectory(prefix="h2o-ui-chromium-") as profile,
        sync_playwright() as playwright,
    ):
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": width, "height": height},
            device_scale_factor=scale,
            color_scheme="light",
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


class ChatPage:
    """The page's controls, driven the way a keyboard-and-mouse user drives them."""

    def __init__(self, page, base_url: str):
        self.page, self.base_url = page, base_url

    def open(self) -> None:
        self.page.goto(self.base_url + "/")
        self.page.wait_for_selector("#set-policy option", state="attached")  # /ui/options

    def enter_key(self, key: str) -> None:
        """Type the API key into the dialog the page opens when the server needs one."""
        self.page.wait_for_selector("#key-dialog[open]")
        self.page.fill("#key-input", key)
        self.page.press("#key-input", "Enter")
        self.page.wait_for_selector("#key-dialog:not([open])", state="attached")

    def new_chat(self, policy: str = "", max_kv: int | None = None, max_tokens: int = 32) -> None:
        self.page.click("#new-chat")
        if not self.page.is_visible("#set-policy"):
            self.page.click("#settings summary")
        self.page.select_option("#set-policy", policy)
        self.page.fill("#set-max-kv", "" if max_kv is None else str(max_kv))
        self.page.fill("#set-max-tokens", str(max_tokens))
        self.page.fill("#set-temperature", "0")
        self.page.press("#set-temperature", "Tab")  # `change` fires on leaving the field
        self.page.click("#settings summary")  # fold the settings again

    def type_message(self, text: str) -> None:
        self.page.fill("#composer-input", text)
        self.page.press("#composer-input", "Enter")
        self.page.wait_for_selector("#stop", state="visible")

    def wait_reply(self, timeout_s: float = 120) -> str:
        """Wait until the reply has finished streaming; return its text."""
        self.page.wait_for_selector("#stop", state="hidden", timeout=timeout_s * 1000)
        return self.page.locator(".message.assistant .content").last.inner_text()

    def current_id(self) -> str:
        return self.page.get_attribute(".conv[aria-current='true']", "data-id")

    def open_cache(self) -> None:
        self.page.click("#tab-cache")
        self.page.wait_for_selector("#cache-view[data-state='loaded'] #fig-logical_tokens")

    def figures(self) -> dict[str, str]:
        """The cache view's figures by name, as the page shows them (data-value)."""
        return self.page.eval_on_selector_all(
            "#figures .figure",
            "nodes => Object.fromEntries(nodes.map(n => [n.id.slice(4), n.dataset.value]))",
        )
