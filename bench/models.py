"""Models on demand: load time per model, the first request's time to first token cold
(its model unloaded) and warm, and four concurrent streams on one model against the
same streams split over two models, one server at a time, rounds A, B, B, A.

Servers: A serves the default model alone; B serves it and gemma3-270m
(`--model default --model gemma3-270m`). In B each round: every model unloaded and
loaded again through `POST /v1/models/load` (its wall time); a streamed chat's time to
first token with its model unloaded (the load included) and then loaded (a new
conversation); four streams on the default model, and two on each model at once. In A:
the four streams on the default model. Streams: greedy, 64 tokens, each its own
conversation (a distinct first line); aggregate tok/s is their tokens over the wall time
from the first request to the last token; CPU seconds are the server process's.

    python -m bench.models [--rounds 3] [--out docs/models_on_demand.md]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import threading
import time
from pathlib import Path

from bench.local_server import start_server, stop_server
from bench.report import command, machine, publish
from bench.server_load import Server

DEFAULT, GEMMA = "default", "gemma3-270m"
IDS = {DEFAULT: "SmolLM2-135M-Instruct", GEMMA: "gemma-3-270m"}
# One cache for every conversation in both servers (policy full, 4096 tokens: what each
# model's half of the budget holds in B), so A and B differ only in the models served.
FLAGS = ["--kv-budget", "4GiB", "--max-sessions", "8", "--max-loaded-models", "2"]
FLAGS += ["--policy", "full", "--context", "4096"]
STREAM_TOKENS = 64
_nonce = itertools.count()


def start(models: list[str]) -> Server:
    flags = [arg for m in models for arg in ("--model", m)]
    process, port = start_server([*flags, *FLAGS], stdout=subprocess.DEVNULL, timeout=300)
    return Server(" + ".join(models), process, port)


def post(server: Server, path: str, body: dict) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return json.loads(urllib.request.urlopen(request, timeout=600).read())


def stream(server: Server, model: str, out: dict, key: str) -> None:
    """One streamed chat: its first and last token times and its tokens, into out[key]."""
    messages = [
        {"role": "user", "content": f"Note {next(_nonce)}. Tell a short story about a lighthouse."}
    ]
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    reply = server.client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=STREAM_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in reply:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            last = time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    out[key] = {"sent": sent, "first": first, "last": last, "tokens": tokens}


def together(server: Server, models: list[str]) -> dict:
    """Streams started at once, one per entry of `models`: aggregate and per-model tok/s."""
    out: dict = {}
    cpu0 = server.cpu_seconds()
    threads = [
        threading.Thread(target=stream, args=(server, m, out, f"{i}:{m}"))
        for i, m in enumerate(models)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start_at = min(r["sent"] for r in out.values())
    end_at = max(r["last"] for r in out.values())
    row = {
        "tok_s": sum(r["tokens"] for r in out.values()) / (end_at - start_at),
        "cpu": server.cpu_seconds() - cpu0,
    }
    for m in set(models):
        mine = [r for k, r in out.items() if k.endswith(":" + m)]
        row[m] = statistics.mean((r["tokens"] - 1) / (r["last"] - r["first"]) for r in mine)
    return row


def first_token(server: Server, model: str) -> float:
    out: dict = {}
    stream(server, model, out, "one")
    return out["one"]["first"] - out["one"]["sent"]


def round_b(server: Server, rows: dict) -> None:
    for model in (DEFAULT, GEMMA):
        post(server, "/v1/models/unload", {"model": model})
        began = time.perf_counter()
        post(server, "/v1/models/load", {"model": model})
        rows.setdefault(f"load {model}", []).append(time.perf_counter() - began)
    for model in (DEFAULT, GEMMA):
        post(server, "/v1/models/unload", {"model": model})
        rows.setdefault(f"ttft cold {model}", []).append(first_token(server, model))
        rows.setdefault(f"ttft warm {model}", []).append(first_token(server, model))
    rows.setdefault("B: 4 x default", []).append(together(server, [DEFAULT] * 4))
    rows.setdefault("B: 4 x gemma", []).append(together(server, [GEMMA] * 4))
    rows.setdefault("B: 2 x default + 2 x gemma", []).append(
        together(server, [DEFAULT, GEMMA, DEFAULT, GEMMA])
    )


def measure(rounds: int) -> dict:
    rows: dict = {}
    for r in range(rounds):
        order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
        for variant in order:
            server = start([DEFAULT] if variant == "A" else [DEFAULT, GEMMA])
            try:
                if variant == "A":
                    together(server, [DEFAULT])  # its first request pays the warm-up
                    rows.setdefault("A: 4 x default", []).append(together(server, [DEFAULT] * 4))
                else:
                    round_b(server, rows)
            finally:
                stop_server(server.process)
        print(f"round {r + 1} of {rounds} done", flush=True)
    return rows


def table(rows: dict) -> str:
    med = statistics.median
    lines = ["| model | load s | first token s, unloaded | first token s, loaded |"]
    lines.append("|---|---|---|---|")
    for model in (DEFAULT, GEMMA):
        lines.append(
            f"| {IDS[model]} | {med(rows[f'load {model}']):.2f} | "
            f"{med(rows[f'ttft cold {model}']):.2f} | {med(rows[f'ttft warm {model}']):.2f} |"
        )
    lines += ["", "| four streams | aggregate tok/s | per stream tok/s | server CPU s |"]
    lines.append("|---|---|---|---|")
    for name in ("A: 4 x default", "B: 4 x default", "B: 4 x gemma", "B: 2 x default + 2 x gemma"):
        runs = rows[name]
        each = ", ".join(
            f"{IDS[m]} {med(run[m] for run in runs):.1f}" for m in (DEFAULT, GEMMA) if m in runs[0]
        )
        lines.append(
            f"| {name} | {med(r['tok_s'] for r in runs):.1f} | {each} | "
            f"{med(r['cpu'] for r in runs):.1f} |"
        )
    a, b = rows["A: 4 x default"], rows["B: 4 x default"]
    ratios = [rb["tok_s"] / ra["tok_s"] for ra, rb in zip(a, b, strict=True)]
    lines += [
        "",
        f"B / A, four streams on the default model, per round: "
        f"{', '.join(f'{x:.2f}' for x in ratios)} (median {med(ratios):.2f}).",
    ]
    return "\n".join(lines)


INTRO = """Medians over the rounds. A serves the default model alone, B serves it and
gemma3-270m (both float32 on this CPU), both with `--policy full --context 4096
--kv-budget 4GiB`: each model's half of the budget in B still holds every conversation
whole, so both servers decode with the same cache (under `auto`, A's larger share would
pick another). Each round starts each server afresh, A first in even rounds and B first
in odd ones. Load: `POST /v1/models/load` of an unloaded model. First token: a streamed
chat's time to its first token, with its model unloaded (the load included) and then
loaded (a new conversation). Four streams of 64 greedy tokens at once: on the default
model in A and in B (the registry's cost: B / A), on gemma in B, and two on each model in
B (the single worker runs each model's batch in turn)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/models_on_demand.md"))
    args = parser.parse_args(argv)
    rows = measure(args.rounds)
    body = [machine(), "", table(rows)]
    publish("Models on demand", INTRO, command("bench.models", argv), body, args.out)


if __name__ == "__main__":
    main()
