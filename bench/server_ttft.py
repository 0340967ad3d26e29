"""Time to first token of a multi-turn chat: the session's cache vs a cold request.

Starts `h2o-server serve` on a loopback port and holds one conversation whose
user turns are essay passages. At each turn it sends the same history twice,
in alternating order: once on the conversation's own session (only the new
turn is prefilled) and once under a fresh session key (everything is
prefilled). Both go through the openai SDK with streaming; the time to the
first content chunk is recorded.

    python -m bench.server_ttft --turns 6 --out docs/server_ttft.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import openai

from bench.local_server import start_server, stop_server
from bench.report import command, publish
from bench.text import essay_text

MODEL = "default"


def ttft(
    client: openai.OpenAI,
    messages: list[dict],
    key: str,
    max_tokens: int,
    kv_cache: dict | None = None,
) -> tuple:
    """(seconds to the first content chunk, reply text, cached prompt tokens, prompt tokens)."""
    extra = {"kv_cache": kv_cache} if kv_cache else {}
    start, first, text, usage = time.perf_counter(), None, "", None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"prompt_cache_key": key, **extra},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    return (
        (first or time.perf_counter()) - start,
        text,
        usage.prompt_tokens_details.cached_tokens,
        usage.prompt_tokens,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--passage-chars", type=int, default=1200, help="essay text per user turn")
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--kv-budget", default="512MiB")
    p.add_argument("--policy", default="h2o")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    flags = ["--kv-budget", args.kv_budget, "--policy", args.policy, "--max-sessions", "4"]
    process, port = start_server(["--log-level", "warning", *flags])
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    text = essay_text(max_files=4)
    key = f"bench-{uuid.uuid4().hex[:8]}"
    messages: list[dict] = []
    rows = []
    try:
        for turn in range(args.turns):
            passage = text[turn * args.passage_chars : (turn + 1) * args.passage_chars]
            messages.append({"role": "user", "content": f"{passage}\n\nSummarize this briefly."})
            cold_key = f"cold-{uuid.uuid4().hex[:8]}"
            # Alternate which goes first so machine noise hits both alike.
            if turn % 2:
                cold = ttft(client, messages, cold_key, args.reply_tokens)
                warm = ttft(client, messages, key, args.reply_tokens)
            else:
                warm = ttft(client, messages, key, args.reply_tokens)
                cold = ttft(client, messages, cold_key, args.reply_tokens)
            urllib.request.urlopen(
                urllib.request.Request(f"{base}/v1/sessions/{cold_key}", method="DELETE")
            )
            messages.append({"role": "assistant", "content": warm[1]})
            rows.append((turn + 1, warm[3], warm[2], warm[0], cold[0]))
            print(
                f"turn {turn + 1}: prompt {warm[3]} tok, cached {warm[2]}: "
                f"warm {warm[0]:.2f}s, cold {cold[0]:.2f}s",
                file=sys.stderr,
            )
    finally:
        stop_server(process)

    table = [
        "| turn | prompt tokens | cached tokens | TTFT warm (s) | TTFT cold (s) | cold / warm |",
        "|---|---|---|---|---|---|",
    ]
    for turn, prompt, cached, warm_s, cold_s in rows:
        ratio = cold_s / warm_s
        table.append(
            f"| {turn} | {prompt} | {cached} | {warm_s:.2f} | {cold_s:.2f} | {ratio:.1f}x |"
        )
    later = [cold_s / warm_s for _, _, _, warm_s, cold_s in rows[1:]]
    summary = (
        f"Median cold/warm ratio over turns 2..{args.turns}: **{statistics.median(later):.1f}x**."
        if later
        else ""
    )
    publish(
        "Time to first token: session cache vs cold request",
        f"Default model, server policy `{args.policy}`, `--kv-budget {args.kv_budget}`, "
        f"{args.turns} turns of ~{args.passage_chars} characters of essay text, replies of "
        f"{args.reply_tokens} tokens, greedy. Warm = the conversation's own session (only "
        "the new turn is prefilled); cold = the same history under a fresh session key. "
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores.",
        command("bench.server_ttft", argv),
        [*table, "", summary],
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
