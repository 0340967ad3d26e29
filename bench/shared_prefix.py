"""Shared system prompts: time to first token of new chats that start alike.

Four conversations, one after another, each with the same ~2000-token system prompt
(essay text) and its own question, on this server and on mlx_lm.server with the same
float32 weights (bench/mlx_folder.py), one server process at a time, fresh for every
round; rounds alternate the servers' order. This server runs twice: in its default
policy, and with `kv_cache: {policy: h2o, max_kv: 512}`, a cache that evicts inside the
system prompt. Streaming, greedy, through the openai SDK; the time to the first content
chunk is recorded, with `cached_tokens` and the server process's CPU seconds.

    python -m bench.shared_prefix --rounds 2 --out docs/shared_prefix.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.local_server import stop_server
from bench.mlx_folder import export_default
from bench.report import command, machine, publish
from bench.server_load import MLX_LM, OURS, Server, passages, start_mlx_lm, start_ours

QUESTIONS = [
    "What is the main argument of this text?",
    "Name one example the author gives.",
    "Who is the intended reader?",
    "What would the author advise a beginner?",
    "Summarize the text in one sentence.",
    "What is surprising about the text?",
]
H2O = {"policy": "h2o", "max_kv": 512}


def first_token(server: Server, system: str, question: str, reply_tokens: int) -> dict:
    """One new conversation: seconds to its first content chunk, and its cached tokens."""
    ours = server.name == OURS
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    start, first, usage = time.perf_counter(), None, None
    stream = server.client.chat.completions.create(
        model="default" if ours else "default_model",
        messages=messages,
        temperature=0,
        max_tokens=reply_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=server.extra if ours else {},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
        if chunk.usage:
            usage = chunk.usage
    details = usage.prompt_tokens_details if usage else None
    return {
        "ttft": (first or time.perf_counter()) - start,
        "cached": (details.cached_tokens or 0) if details else 0,
        "prompt": usage.prompt_tokens if usage else 0,
    }


def start(variant: str, folder: Path) -> Server:
    if variant == MLX_LM:
        return start_mlx_lm(folder)
    server = start_ours(folder, ["--max-sessions", "8"])
    if variant.endswith("h2o"):
        server.extra = {"kv_cache": H2O}
    return server


def run(args) -> list[dict]:
    from mlx_lm.utils import load_tokenizer

    folder = export_default()
    tokenizer = load_tokenizer(folder)
    system = "Answer questions about this text.\n\n" + passages(tokenizer, 1, args.system, 0)[0]
    variants = [OURS, f"{OURS} h2o", MLX_LM]
    records = []
    for rnd in range(args.rounds):
        for variant in variants if rnd % 2 == 0 else variants[::-1]:
            server = start(variant, folder)
            try:
                cpu0 = server.cpu_seconds()
                for chat in range(args.chats):
                    question = QUESTIONS[(rnd + chat) % len(QUESTIONS)]
                    result = first_token(server, system, question, args.reply_tokens)
                    records.append({"round": rnd, "server": variant, "chat": chat + 1, **result})
                    print(records[-1], file=sys.stderr, flush=True)
                records[-1]["cpu_s"] = server.cpu_seconds() - cpu0
            finally:
                stop_server(server.process)
    return records


def table(records: list[dict], chats: int) -> list[str]:
    def median(server: str, chat: int, key: str = "ttft") -> float:
        return statistics.median(
            r[key] for r in records if r["server"] == server and r["chat"] == chat
        )

    def later(server: str) -> float:
        """Chats 2.. as one median over rounds and chats."""
        return statistics.median(
            r["ttft"] for r in records if r["server"] == server and r["chat"] > 1
        )

    servers = list(dict.fromkeys(r["server"] for r in records))
    head = " | ".join(f"chat {c} TTFT s (cached)" for c in range(1, chats + 1))
    rows = [
        f"| server | {head} | chats 2-{chats} / chat 1 | chats 2-{chats} / mlx_lm.server's | "
        "CPU s per round |",
        "|---|" + "---|" * (chats + 3),
    ]
    for server in servers:
        cells = [
            f"{median(server, c):.2f} ({median(server, c, 'cached'):.0f})"
            for c in range(1, chats + 1)
        ]
        cpu = statistics.median(
            r["cpu_s"] for r in records if r["server"] == server and "cpu_s" in r
        )
        rows.append(
            f"| {server} | {' | '.join(cells)} | {later(server) / median(server, 1):.3f}x | "
            f"{later(server) / later(MLX_LM):.2f}x | {cpu:.1f} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--system", type=int, default=2000, help="essay tokens in the system prompt")
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    records = run(args)
    prompt = max(r["prompt"] for r in records)
    publish(
        "Shared system prompts: time to first token of new chats",
        f"{args.chats} new conversations one after another, each with the same system prompt "
        f"({args.system} tokens of essay text; {prompt} prompt tokens with the question) and "
        f"its own question; replies of {args.reply_tokens} tokens, greedy, streamed. Default "
        "model's float32 weights on both servers; one server process at a time, fresh each "
        f"round, {args.rounds} rounds in alternating order; medians over rounds (chats 2-"
        f"{args.chats}: over rounds and chats). `h2o-server h2o`: `kv_cache: {H2O}` (evicts "
        f"inside the system prompt). Cached = `cached_tokens` reported. {machine()}.",
        command("bench.shared_prefix", argv),
        table(records, args.chats),
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
