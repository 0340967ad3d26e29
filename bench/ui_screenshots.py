"""Screenshots of the chat page for docs/ui.md: a chat, and the cache view after eviction.

    python -m bench.ui_screenshots --out docs

Starts the real server on a free loopback port with the default model, drives the
page in Debian's headless Chromium (bench/ui_browser.py) and writes
ui-chat.png and ui-cache.png.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from bench.local_server import start_server, stop_server
from bench.text import essay_text
from bench.ui_browser import ChatPage, browser_page, missing_browser

QUESTIONS = [
    "Give me three tips for writing clear documentation.",
    "Which one matters most? One sentence.",
]
ESSAY_WORDS = 260  # a pasted text long enough to overflow max_kv 64 several times


def essay_excerpt(words: int = ESSAY_WORDS) -> str:
    """The first words of an essay, without its date line."""
    text = re.sub(r"^[A-Z][a-z]+ \d{4}", "", essay_text(max_files=1))
    return " ".join(text.split()[:words])


def take(out: Path, width: int = 1280) -> None:
    """Two conversations: one evicting at max_kv 64 (the cache view), one plain chat."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "w") as log:
        process, port = start_server(["--kv-budget", "512MiB"], stdout=log)
        try:
            with browser_page(width, 1480) as page:
                ui = ChatPage(page, f"http://127.0.0.1:{port}")
                ui.open()
                ui.new_chat(policy="h2o", max_kv=64, max_tokens=24)
                ui.type_message(f"{essay_excerpt()}\n\nWho wrote this? Answer in one sentence.")
                ui.wait_reply()
                ui.type_message("Summarize it in one sentence.")
                ui.wait_reply()
                evicting = ui.current_id()

                ui.new_chat(max_tokens=90)
                for question in QUESTIONS:
                    ui.type_message(question)
                    ui.wait_reply()
                page.set_viewport_size({"width": width, "height": 820})
                page.eval_on_selector("#messages", "m => { m.scrollTop = m.scrollHeight }")
                page.screenshot(path=str(out / "ui-chat.png"))

                page.set_viewport_size({"width": width, "height": 1480})
                page.click(f".conv[data-id='{evicting}']")
                ui.open_cache()
                page.hover("#tokens .tok.seg-heavy >> nth=3")
                page.screenshot(path=str(out / "ui-cache.png"))
        finally:
            stop_server(process)


def shrink(path: Path) -> None:
    """A 256-colour palette: flat UI colours survive, the file is a third of the size."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    reason = missing_browser()
    if reason:
        print(f"ui_screenshots: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    take(args.out)
    for name in ("ui-chat.png", "ui-cache.png"):
        path = args.out / name
        shrink(path)
        print(f"{path}: {path.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
