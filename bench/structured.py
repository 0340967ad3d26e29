"""Constrained decoding's cost: decode tok/s of a json_schema reply vs a free one.

One server (default model), streaming through the openai SDK, greedy. Both kinds of
reply run to the same `--tokens` (the schema asks for more items than fit, the free
prompt for a long story), alone and as `--streams` concurrent requests of one kind,
interleaved (free, constrained, constrained, free, ...) over `--rounds`. Decode tok/s:
tokens after the first over the time from the first content chunk to the last; the
server process's CPU seconds per case are recorded too.

    python -m bench.structured --rounds 3 --out docs/structured.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

from bench.local_server import stop_server
from bench.report import command, machine, publish
from bench.server_load import Server, start_ours

# More items than `--tokens` can hold: every constrained reply is cut at the same length.
SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "country": {"type": "string", "maxLength": 20},
                },
                "required": ["name", "country"],
                "additionalProperties": False,
            },
            "minItems": 100,
            "maxItems": 100,
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}
PROMPTS = {
    "free": "Write a long story about a lighthouse keeper and a storm.",
    "json_schema": "List cities of the world with their countries, as JSON.",
}


def one_reply(server: Server, kind: str, tokens: int) -> tuple[int, float]:
    """(tokens after the first, seconds from the first content chunk to the last)."""
    extra = {}
    if kind == "json_schema":
        extra["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "cities", "schema": SCHEMA, "strict": True},
        }
    stream = server.client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": PROMPTS[kind]}],
        temperature=0,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    first = last = None
    completion = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage:
            completion = chunk.usage.completion_tokens
    return completion - 1, (last - first) if first and last else 0.0


def case(server: Server, kind: str, streams: int, tokens: int) -> dict:
    cpu0 = server.cpu_seconds()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        replies = list(pool.map(lambda _: one_reply(server, kind, tokens), range(streams)))
    rates = [n / s for n, s in replies if s > 0]
    return {
        "kind": kind,
        "streams": streams,
        "tok_s": sum(rates),  # per stream rates add up: the streams decode together
        "tokens": statistics.median(n + 1 for n, _ in replies),
        "cpu_s": server.cpu_seconds() - cpu0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    server = start_ours("default", ["--max-sessions", str(2 * args.streams)])
    records = []
    try:
        one_reply(server, "json_schema", 8)  # the grammar engine reads the vocabulary once
        for rnd in range(args.rounds):
            for streams in (1, args.streams):
                kinds = ["free", "json_schema"] if rnd % 2 == 0 else ["json_schema", "free"]
                for kind in kinds:
                    records.append({"round": rnd, **case(server, kind, streams, args.tokens)})
                    print(records[-1], file=sys.stderr, flush=True)
    finally:
        stop_server(server.process)

    rows = [
        "| streams | free tok/s | json_schema tok/s | ratio | tokens per reply "
        "| CPU s free / json |",
        "|---|---|---|---|---|---|",
    ]
    for streams in (1, args.streams):

        def pick(kind: str, key: str, streams: int = streams) -> list[float]:
            return [r[key] for r in records if r["kind"] == kind and r["streams"] == streams]

        ratios = [
            c / f for f, c in zip(pick("free", "tok_s"), pick("json_schema", "tok_s"), strict=True)
        ]
        rows.append(
            f"| {streams} | {statistics.median(pick('free', 'tok_s')):.1f} | "
            f"{statistics.median(pick('json_schema', 'tok_s')):.1f} | "
            f"**{statistics.median(ratios):.2f}x** | "
            f"{statistics.median(pick('free', 'tokens')):.0f} / "
            f"{statistics.median(pick('json_schema', 'tokens')):.0f} | "
            f"{statistics.median(pick('free', 'cpu_s')):.1f} / "
            f"{statistics.median(pick('json_schema', 'cpu_s')):.1f} |"
        )
    publish(
        "Constrained decoding: json_schema replies vs free ones",
        f"Default model, server defaults, greedy, streamed; replies cut at {args.tokens} "
        f"tokens; {args.rounds} rounds, the two kinds interleaved (order alternating). "
        "Decode tok/s: tokens after the first over the time from the first content chunk "
        "to the last, summed over concurrent streams; the ratio is json_schema / free "
        f"within each round, then the median. {machine()}.",
        command("bench.structured", argv),
        rows,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
