"""Reuse that survives eviction: an edited last reply trims the session, what that costs.

Starts `h2o-server serve` on a loopback port. Each chat: turn 1 asks about an
essay passage (long enough that an H2O cache of `max_kv` tokens evicts), turn 2
sends turn 1's reply with its last word dropped (as a UI that trims a cut-off
word does) plus a follow-up question. Turn 2 goes once on the chat's own
session (the server trims the cache back to the edit, inside the recent window
it still holds) and once under a fresh key (rebuilt from the prompt), in
alternating order. Reported: cached tokens, TTFT, and how far the two greedy
replies agree (identical, words in common from the start, difflib ratio).

    python -m bench.edit_reuse --chats 6 --out docs/edit_reuse.md
"""

from __future__ import annotations

import argparse
import difflib
import os
import platform
import statistics
import sys
import urllib.request
import uuid
from pathlib import Path

import openai

from bench.local_server import start_server, stop_server
from bench.report import command, publish
from bench.server_ttft import ttft
from bench.text import essay_text

QUESTIONS = ["What is the main claim here?", "Who would disagree, and why?"]


def common_words(a: str, b: str) -> int:
    """Words the two texts share from the start."""
    n = 0
    for x, y in zip(a.split(), b.split(), strict=False):
        if x != y:
            break
        n += 1
    return n


def turn_two(
    client, passage: str, question: str, kv: dict, reply_tokens: int, edit: bool, order: int
):
    """Turn 1 on a fresh session, then turn 2 warm (that session) and cold (a fresh key)."""
    key = f"edit-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": f"{passage}\n\nSummarize this in detail."}]
    _, reply, _, prompt = ttft(client, messages, key, reply_tokens, kv)
    if edit and " " in reply.strip():
        reply = reply.rsplit(" ", 1)[0]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    cold_key = f"cold-{uuid.uuid4().hex[:8]}"
    runs = [(key, "warm"), (cold_key, "cold")][:: 1 if order % 2 == 0 else -1]
    got = {name: ttft(client, messages, k, reply_tokens, kv) for k, name in runs}
    for k in (key, cold_key):
        url = f"{client.base_url}sessions/{k}"
        urllib.request.urlopen(urllib.request.Request(url, method="DELETE"))
    return prompt + reply_tokens, got["warm"], got["cold"]


def one_chat(client, passage: str, question: str, max_kv: int, reply_tokens: int, order: int):
    """(turn-1 tokens, warm, cold) with the reply edited, and (warm, cold) unedited."""
    kv = {"policy": "h2o", "max_kv": max_kv}
    turn1, warm, cold = turn_two(client, passage, question, kv, reply_tokens, True, order)
    _, same_warm, same_cold = turn_two(client, passage, question, kv, reply_tokens, False, order)
    return turn1, warm, cold, (same_warm, same_cold)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--max-kv", type=int, nargs="+", default=[64, 128])
    p.add_argument("--passage-chars", type=int, default=600)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    process, port = start_server(["--log-level", "warning", "--max-sessions", "4"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    text = essay_text(max_files=4)
    rows = []
    try:
        for max_kv in args.max_kv:
            for i in range(args.chats):
                passage = text[i * args.passage_chars : (i + 1) * args.passage_chars]
                question = QUESTIONS[i % len(QUESTIONS)]
                turn1, warm, cold, control = one_chat(
                    client, passage, question, max_kv, args.reply_tokens, i
                )
                ratio = difflib.SequenceMatcher(None, warm[1], cold[1]).ratio()
                base = difflib.SequenceMatcher(None, control[0][1], control[1][1]).ratio()
                rows.append((max_kv, i + 1, turn1, warm, cold, ratio, base))
                progress = f"cached {warm[2]} vs {cold[2]}, ttft {warm[0]:.2f} vs {cold[0]:.2f}s"
                print(f"kv {max_kv} chat {i + 1}: {progress}, ratio {ratio:.2f}", file=sys.stderr)
    finally:
        stop_server(process)
    publish(
        "Edited last reply after eviction: trim vs rebuild",
        f"Default model, per-request `kv_cache` {{policy h2o, max_kv}}, {args.chats} chats per "
        f"max_kv, essay passages of {args.passage_chars} characters, replies of "
        f"{args.reply_tokens} tokens, greedy. Turn 2 drops the last word of turn 1's reply. "
        "Warm = the chat's session, trimmed to the edit; cold = the same prompt under a "
        "fresh key (rebuilt). Word agreement: words the two replies share from the start; "
        "similarity: difflib ratio of the two replies. Control: the same chat with turn 1's "
        "reply unedited, its session (no trim) vs a rebuild: how far an evicting session and "
        "a rebuild disagree without any trim (they evict different middle tokens). "
        f"Machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores.",
        command("bench.edit_reuse", argv),
        table(rows, args.max_kv),
        args.out,
    )
    return 0


def table(rows: list, sizes: list[int]) -> list[str]:
    lines = [
        "| max_kv | chat | turn-1 tokens | cached warm / cold | TTFT warm / cold (s) "
        "| same reply | words agreeing | similarity | unedited: similarity |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for max_kv, i, turn1, warm, cold, ratio, base in rows:
        same = "yes" if warm[1] == cold[1] else "no"
        lines.append(
            f"| {max_kv} | {i} | {turn1} | {warm[2]} / {cold[2]} | {warm[0]:.2f} / {cold[0]:.2f} "
            f"| {same} | {common_words(warm[1], cold[1])} / {len(cold[1].split())} | {ratio:.2f} "
            f"| {base:.2f} |"
        )
    lines.append("")
    for max_kv in sizes:
        mine = [r for r in rows if r[0] == max_kv]
        same = sum(r[3][1] == r[4][1] for r in mine)
        speed = statistics.median(r[4][0] / r[3][0] for r in mine)
        lines.append(
            f"- max_kv {max_kv}: {same}/{len(mine)} replies identical to the rebuild's, median "
            f"similarity {statistics.median(r[5] for r in mine):.2f} (unedited control, session "
            f"vs rebuild: {statistics.median(r[6] for r in mine):.2f}), every warm turn reused "
            f"{min(r[3][2] for r in mine)}+ tokens, median TTFT cold/warm {speed:.1f}x."
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
