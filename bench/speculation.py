"""Speculative decoding: decode tok/s and passes per token with drafts on and off, and
mlx_lm.server on the same weights, one server at a time, rounds A, B, C, A, B, C.

Cases (greedy, streamed through the openai SDK):
  (a) rewrite a 150-line file shown in the prompt with one change;
  (b) a summary that first quotes the pasted document;
  (c) free chat;
  (d) a JSON-schema reply and a forced tool call;
  (e) four streams at once: (a), (b) and two free chats (their tokens over the time from
      sending them to the last one, prefills included).
Each of ours runs under the server's `auto` policy and under an evicting h2o cache
(`kv_cache: {policy: h2o, max_kv: 256}`). Decode tok/s is (completion tokens - 1) over the
time from the first streamed token to the last; passes per token come from /metrics;
CPU seconds are the server process's over the request.

    python -m bench.speculation [--rounds 4] [--cases abcde] [--out docs/speculation.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.mlx_folder import export_embedded
from bench.report import command, machine, publish
from bench.server_load import MLX_LM, OURS, Server, start_mlx_lm, start_ours
from bench.text import essay_text

SPEC, PLAIN = "h2o-server, drafts", "h2o-server, no drafts"
H2O = {"kv_cache": {"policy": "h2o", "max_kv": 256}}
# The cache policies a case runs under, by the name the table gives: auto (the server's),
# dense H2O evicting past 256 tokens, kvarn from the first token (auto past its share).
POLICIES = {"auto": {}, "h2o 256": H2O, "kvarn": {"kv_cache": {"policy": "kvarn"}}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city_name": {"type": "string"},
                "temperature_unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city_name", "temperature_unit"],
        },
    },
}
REPORT = {
    "type": "json_schema",
    "json_schema": {
        "name": "weather_report",
        "schema": {
            "type": "object",
            "properties": {
                "city_name": {"type": "string", "maxLength": 24},
                "temperature_in_celsius": {"type": "integer"},
                "description_of_the_sky": {"type": "string", "maxLength": 40},
                "chance_of_rain_in_percent": {"type": "integer"},
            },
            "required": [
                "city_name",
                "temperature_in_celsius",
                "description_of_the_sky",
                "chance_of_rain_in_percent",
            ],
            "additionalProperties": False,
        },
    },
}


def source_file(lines: int = 150) -> str:
    """150 lines of mlx-lm's own sampling code: text this project did not write."""
    spec = importlib.util.find_spec("mlx_lm.sample_utils")
    return "".join(Path(spec.origin).read_text().splitlines(keepends=True)[:lines])


def cases() -> dict[str, dict]:
    code, essay = source_file(), essay_text(max_files=3)[:2400]
    return {
        "(a) rewrite a file": {
            "messages": [
                {
                    "role": "user",
                    "content": "Rename `make_sampler` to `build_sampler` in this file and "
                    f"reply with the whole file, nothing else:\n\n{code}",
                }
            ],
            "max_tokens": 160,
        },
        "(a) rewrite, predicted": {
            "messages": [
                {
                    "role": "user",
                    "content": "Rename `make_sampler` to `build_sampler` in this file and "
                    f"reply with the whole file, nothing else:\n\n{code}",
                }
            ],
            "prediction": {"type": "content", "content": code},
            "max_tokens": 160,
        },
        "(b) quote a document": {
            "messages": [
                {
                    "role": "user",
                    "content": f"{essay}\n\nQuote the first paragraph of this essay word for "
                    "word, then summarize the essay in three sentences.",
                }
            ],
            "max_tokens": 120,
        },
        "(c) free chat": {
            "messages": [
                {
                    "role": "user",
                    "content": "Tell me a story about a lighthouse keeper who finds a "
                    "message in a bottle.",
                }
            ],
            "max_tokens": 100,
        },
        "(c) another chat": {
            "messages": [
                {"role": "user", "content": "Explain how a bicycle stays upright, simply."}
            ],
            "max_tokens": 100,
        },
        "(d) JSON schema": {
            "messages": [{"role": "user", "content": "The weather in Lisbon today, as JSON."}],
            "response_format": REPORT,
            "max_tokens": 80,
        },
        "(d) forced tool call": {
            "messages": [{"role": "user", "content": "What is the weather in Lisbon?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_current_weather"}},
            "max_tokens": 60,
        },
        # Four streams at once (a rewrite, a quote, two chats): their decode passes batch.
        "(e) 4 streams": {
            "streams": [
                "(a) rewrite a file",
                "(b) quote a document",
                "(c) free chat",
                "(c) another chat",
            ]
        },
    }


def run_case(server: Server, body: dict, extra: dict) -> dict:
    """One streamed request (several at once for `streams`): decode tok/s (for streams,
    their tokens over the time from sending them to the last token), tokens, passes per
    token, server CPU seconds."""
    ours = server.name == OURS
    before = metrics(server) if ours else {}
    cpu0 = server.cpu_seconds()
    if "streams" in body:  # from sending them to the last token: when the first token
        # comes depends on which prompt the server takes first, the prefills are the same
        every, sent = cases(), time.perf_counter()
        with ThreadPoolExecutor(len(body["streams"])) as pool:
            runs = list(pool.map(lambda c: stream(server, every[c], extra), body["streams"]))
        tokens = sum(n for _, n in runs)
        rate = tokens / (max(s[-1] for s, _ in runs) - sent)
    else:
        stamps, tokens = stream(server, body, extra)
        seconds = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
        rate = (tokens - 1) / seconds
    row = {"tokens": tokens, "tok_s": rate, "cpu": server.cpu_seconds() - cpu0}
    if ours:
        after = metrics(server)
        passes = after["h2o_decode_passes_total"] - before["h2o_decode_passes_total"]
        row["passes_per_token"] = passes / tokens
    return row


def stream(server: Server, body: dict, extra: dict) -> tuple[list[float], int]:
    """(the times its content arrived, its completion tokens) of one streamed request."""
    ours = server.name == OURS
    stamps, usage = [], None
    stream = server.client.chat.completions.create(
        model="default" if ours else "default_model",
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra if ours else {},
        **body,
    )
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
            stamps.append(time.perf_counter())
        if chunk.usage:
            usage = chunk.usage
    return stamps, usage.completion_tokens


def metrics(server: Server) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
    return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln[:1] != "#")}


def measure(
    rounds: int, letters: str = "abcde", policies: tuple = ("auto", "h2o 256"), model="default"
) -> dict:
    """{(variant, policy, case): [row per round]}, variants interleaved within each round;
    `letters`: the cases run, by their letter; `policies`: POLICIES' names; `model`: the
    embedded model served (models/loading.py: default, gemma3-270m)."""
    folder = export_embedded(model)
    work = {
        name: body
        for name, body in cases().items()
        if name[1] in letters and name != "(c) another chat"  # a stream of (e)
    }
    results: dict = {}
    variants = [
        (SPEC, lambda: start_ours(folder, ["--draft-max", "12"])),
        (PLAIN, lambda: start_ours(folder, ["--draft-max", "0"])),
        (MLX_LM, lambda: start_mlx_lm(folder)),
    ]
    for r in range(rounds):
        # drafts, none, mlx_lm.server; then none, drafts, mlx_lm.server: neither goes first always
        order = variants if r % 2 == 0 else [variants[1], variants[0], variants[2]]
        for name, start in order:
            server = start()
            try:
                run_case(server, cases()["(c) free chat"], {})  # warm-up
                runs = [(p, POLICIES[p]) for p in policies] if name != MLX_LM else [("-", {})]
                for policy, extra in runs:
                    for case, body in work.items():
                        if name == MLX_LM and (case.startswith("(d)") or "prediction" in body):
                            continue  # no grammar, no prediction there: not comparable
                        row = run_case(server, body, extra)
                        results.setdefault((name, policy, case), []).append(row)
                        print(f"round {r} {name:24} {policy:8} {case:22} {row}", flush=True)
            finally:
                server.process.terminate()
                server.process.wait()
    return results


def table(results: dict) -> str:
    lines = [
        "| case | policy | drafts tok/s | no drafts tok/s | ratio (median of rounds) "
        "| passes/token drafts | CPU s drafts / none | mlx_lm.server tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in cases():
        for policy in POLICIES:
            spec, plain = results.get((SPEC, policy, case)), results.get((PLAIN, policy, case))
            if not spec or not plain:
                continue
            ratios = [s["tok_s"] / p["tok_s"] for s, p in zip(spec, plain, strict=True)]
            anchor = results.get((MLX_LM, "-", case))
            theirs = f"{statistics.median(r['tok_s'] for r in anchor):.1f}" if anchor else "-"
            lines.append(
                f"| {case} | {policy} | {statistics.median(r['tok_s'] for r in spec):.1f} "
                f"| {statistics.median(r['tok_s'] for r in plain):.1f} "
                f"| {statistics.median(ratios):.2f}x "
                f"| {statistics.median(r['passes_per_token'] for r in spec):.2f} "
                f"| {statistics.median(r['cpu'] for r in spec):.1f} / "
                f"{statistics.median(r['cpu'] for r in plain):.1f} | {theirs} |"
            )
    return "\n".join(lines)


INTRO = """\
Speculative decoding feeds a draft of the next tokens beside the decoding token, in one
forward pass, and keeps the drafted tokens the model would have produced itself
(server/engine/speculation.py). Drafts cost no model: the tokens that followed the latest
earlier copy of the conversation's last 2-4 tokens (its whole history: every turn's prompt
and reply, then a chat request's `prediction`, OpenAI's Predicted Outputs), and the
tokens a grammar forces (a JSON schema's keys, a forced tool call's name). The draft
length doubles while drafts are taken whole and pauses where nothing is taken; a lookup
draft goes out only where its source (a predicted reply, a 4-, 3- or 2-token suffix
match) has been right often enough that the tokens it should add beat the wider pass's
cost (`Acceptance` in server/engine/speculation.py). Greedy
replies are token for token the ones without drafts; sampled ones keep the model's
distribution (the accept/resample rule; tests/test_speculation.py).

Where it runs today: a conversation decoding alone whose caches are mlx-lm's plain
KVCache (policy `full`, and `auto`'s kvarn until its dense share), where a refused
draft is trimmed back exactly, or dense H2O caches (`h2o 256` below; `h2o-merge`), also while they
evict: a draft fits before the layer's next eviction, and the pass's scores wait for the
verdict (docs/speculation.md), and kvarn once packed (drafts stay in its dense tail).
Several streams decoding together speculate in the round's one pass: a drafting row leaves
its slab, rows are right-padded to the widest, and a draft goes out only where it pays for
widening every row (case (e)). Packed H2O caches, sliding windows and recurrent layers
decode one token a pass as before.
`--draft-max 0` turns it off, and a
request's `speculation: false` for that request; usage reports
`completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens`
and /metrics `h2o_draft_tokens_total`, `h2o_accepted_draft_tokens_total`,
`h2o_decode_passes_total`.

Decode tok/s: (completion tokens - 1) over the time from the first streamed token to the
last, median over rounds; the ratio is drafts / no drafts within each round, then the
median. Passes per token from /metrics (1.0 without drafts: one pass a token). Servers run
one at a time: drafts, no drafts, mlx_lm.server in even rounds, no drafts first in odd
ones. `(a) rewrite, predicted` sends the file as the request's `prediction`. mlx_lm.server
(plain, no draft model: none with this tokenizer is embedded) runs only the free-text
cases; it has no grammar for (d)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("docs/speculation.md"))
    parser.add_argument("--cases", default="abcde", help="the cases run, by letter (e.g. ac)")
    parser.add_argument(
        "--policies", nargs="+", default=["auto", "h2o 256"], choices=list(POLICIES)
    )
    parser.add_argument("--model", default="default", help="an embedded model: gemma3-270m")
    args = parser.parse_args(argv)
    results = measure(args.rounds, args.cases, tuple(args.policies), args.model)
    body = [machine(), f"Model: {args.model}", "", table(results)]
    line = command("bench.speculation", argv)
    publish("Speculative decoding", INTRO, line, body, args.out)


if __name__ == "__main__":
    main()
