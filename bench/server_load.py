"""Concurrent streaming chats against this server and mlx_lm.server, on the same weights.

Both servers serve the default model's float32 weights from one MLX folder
(bench/mlx_folder.py), on loopback, with OpenBLAS loaded in both (LD_PRELOAD for
mlx_lm.server). Clients are the openai SDK, streaming, greedy.

1. Load: N concurrent multi-turn chats (N = 1, 4, 8), every client holding its
   own conversation (essay passages as user turns, the replies kept in the
   history). Per run: aggregate completion tokens per second of wall time,
   time to first token p50/p95 over all requests, the server's CPU seconds.
   The servers alternate (A, B, then B, A) within each round over several
   rounds; ratios are taken run by run within a round.
2. Long chats, the case this project exists for: 8 concurrent chats whose
   histories reach ~4k tokens (a long pasted document, then short turns),
   this server with `kv_cache: {policy: h2o, max_kv: 512}` vs mlx_lm.server's
   full caches: aggregate tok/s and TTFT of the turns after the document,
   peak RSS of each server process, and KV memory (ours: the server's
   h2o_cache_bytes; mlx_lm.server's: the tokens its caches hold x the full
   cache's bytes per token, a lower bound since its prompt cache may keep
   copies). Fresh server processes for this part.

    python -m bench.server_load --out docs/server_load.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import openai

from bench.local_server import free_port, start_server, stop_server, wait_healthy
from bench.mlx_folder import export_default
from bench.report import command, machine, publish
from bench.text import essay_token_ids

OURS, MLX_LM = "h2o-server", "mlx_lm.server"


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    port: int
    extra: dict = field(default_factory=dict)  # per-request extension fields

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-", max_retries=0, timeout=3600
        )

    def cpu_seconds(self) -> float:
        """utime + stime of the server process (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def openblas() -> str | None:
    from config.blas import loaded_path

    return loaded_path


def start_ours(folder: Path, flags: list[str]) -> Server:
    process, port = start_server(["--model", str(folder), *flags], stdout=subprocess.DEVNULL)
    return Server(OURS, process, port)


def start_mlx_lm(folder: Path) -> Server:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if openblas():
        env["LD_PRELOAD"] = openblas()  # the same BLAS as ours: config/blas.py
    exe = Path(sys.executable).parent / "mlx_lm.server"
    cmd = [str(exe), "--model", str(folder), "--port", str(port), "--max-tokens", "4096"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_healthy(process, port, path="/v1/models")
    return Server(MLX_LM, process, port)


# ---------------------------------------------------------------------- clients


@dataclass
class Conversation:
    """One client's chat: its session key and the history it sends each turn."""

    key: str = field(default_factory=lambda: f"load-{uuid.uuid4().hex[:12]}")
    messages: list[dict] = field(default_factory=list)

    def turn(self, server: Server, text: str, max_tokens: int) -> dict:
        """One streaming request: time to first content, completion tokens; reply kept."""
        self.messages.append({"role": "user", "content": text})
        ours = server.name == OURS
        extra = {"prompt_cache_key": self.key, **server.extra} if ours else {}
        start, first, reply, usage, chunks = time.perf_counter(), None, "", None, 0
        stream = server.client.chat.completions.create(
            model="default" if ours else "default_model",
            messages=self.messages,
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                reply += chunk.choices[0].delta.content
                chunks += 1
            if chunk.usage:
                usage = chunk.usage
        self.messages.append({"role": "assistant", "content": reply})
        tokens = usage.completion_tokens if usage else chunks
        return {"ttft": (first or time.perf_counter()) - start, "tokens": tokens}


def run_clients(
    server: Server, work: list[tuple[Conversation, list[str]]], max_tokens: int
) -> dict:
    """Every (conversation, user turns) as its own concurrent client, turns in order."""
    peak, stop = [server.rss()], threading.Event()

    def sample_rss() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], server.rss())

    def client(item: tuple[Conversation, list[str]]) -> list[dict]:
        conversation, texts = item
        return [conversation.turn(server, text, max_tokens) for text in texts]

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    cpu0, t0 = server.cpu_seconds(), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        turns = [t for c in pool.map(client, work) for t in c]
    wall, cpu = time.perf_counter() - t0, server.cpu_seconds() - cpu0
    stop.set()
    sampler.join()
    ttfts = sorted(t["ttft"] for t in turns)
    tokens = sum(t["tokens"] for t in turns)
    return {
        "tok_s": tokens / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "cpu_s": cpu,
        "wall_s": wall,
        "peak_rss": peak[0],
        "tokens": tokens,
    }


def passages(tokenizer, n: int, length: int, start: int) -> list[str]:
    """n essay passages of `length` tokens, from essay token `start` on."""
    ids = essay_token_ids(tokenizer, start + n * length)
    return [tokenizer.decode(ids[start + i * length : start + (i + 1) * length]) for i in range(n)]


# ---------------------------------------------------------------------- the two parts


def load_runs(folder: Path, tokenizer, args) -> list[dict]:
    """Part 1: N concurrent chats on each server, alternating order, several rounds."""
    servers = [start_ours(folder, ["--max-sessions", str(max(args.streams) * 2)]),
               start_mlx_lm(folder)]  # fmt: skip
    if args.policy:
        servers[0].extra = {"kv_cache": {"policy": args.policy, "max_kv": args.max_kv}}
    records, used = [], 0
    try:
        for rnd in range(args.rounds):
            for n in args.streams:
                texts = passages(tokenizer, n * args.turns, args.turn_tokens, used)
                used += n * args.turns * args.turn_tokens
                order = servers if rnd % 2 == 0 else servers[::-1]
                for server in order:
                    work = [(Conversation(), texts[i * args.turns : (i + 1) * args.turns])
                            for i in range(n)]  # fmt: skip
                    result = run_clients(server, work, args.max_tokens)
                    records.append({"round": rnd, "streams": n, "server": server.name, **result})
                    print(records[-1], file=sys.stderr, flush=True)
    finally:
        for server in servers:
            stop_server(server.process)
    return records


def long_chat_runs(folder: Path, tokenizer, args) -> list[dict]:
    """Part 2: 8 chats growing to ~4k tokens; fresh processes, one server at a time."""
    n = args.long_streams
    documents = passages(tokenizer, n, args.long_document, 40_000)  # past part 1's passages
    follow = passages(
        tokenizer, n * args.long_turns, args.turn_tokens, 40_000 + n * args.long_document
    )
    records = []
    for rnd in range(args.rounds):
        for name in [OURS, MLX_LM] if rnd % 2 == 0 else [MLX_LM, OURS]:
            if name == OURS:
                flags = ["--max-sessions", str(n), "--kv-budget", "4GiB"]
                server = start_ours(folder, flags)
                server.extra = {"kv_cache": {"policy": "h2o", "max_kv": args.long_max_kv}}
            else:
                server = start_mlx_lm(folder)
            try:
                conversations = [Conversation() for _ in range(n)]
                first = [
                    f"Read this document.\n\n{d}\n\nSummarize it in one line." for d in documents
                ]
                warm = run_clients(
                    server, [(c, [t]) for c, t in zip(conversations, first, strict=True)], 16
                )
                texts = [follow[i * args.long_turns : (i + 1) * args.long_turns] for i in range(n)]
                result = run_clients(
                    server, list(zip(conversations, texts, strict=True)), args.max_tokens
                )
                history = max(len(tokenizer.apply_chat_template(c.messages)) for c in conversations)
                kv = kv_bytes(server, conversations, tokenizer, folder)
                records.append({"round": rnd, "server": name, **result, "history_tokens": history,
                                "kv_bytes": kv, "document_seconds": warm["wall_s"]})  # fmt: skip
                print(records[-1], file=sys.stderr, flush=True)
            finally:
                stop_server(server.process)
    return records


def kv_bytes(server: Server, conversations: list[Conversation], tokenizer, folder: Path) -> int:
    """Ours: the KV bytes the server reports. mlx_lm.server: tokens held x full bytes/token."""
    if server.name == OURS:
        url = f"http://127.0.0.1:{server.port}/metrics"
        metrics = urllib.request.urlopen(url, timeout=30).read().decode()
        line = next(x for x in metrics.splitlines() if x.startswith("h2o_cache_bytes "))
        return int(float(line.split()[1]))
    config = json.loads((folder / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * heads * 2 * head_dim * 4  # float32 K and V
    held = sum(len(tokenizer.apply_chat_template(c.messages)) for c in conversations)
    return held * per_token


# ---------------------------------------------------------------------- report


def _median(records: list[dict], key: str, **where) -> float:
    return statistics.median(r[key] for r in records if all(r[k] == v for k, v in where.items()))


def _ratios(records: list[dict], key: str, **where) -> float:
    """Median over rounds of ours / mlx_lm.server, each ratio within one round."""
    mine = {r["round"]: r[key] for r in records if r["server"] == OURS and _match(r, where)}
    theirs = {r["round"]: r[key] for r in records if r["server"] == MLX_LM and _match(r, where)}
    return statistics.median(mine[k] / theirs[k] for k in mine if k in theirs)


def _match(r: dict, where: dict) -> bool:
    return all(r[k] == v for k, v in where.items())


def load_table(records: list[dict], streams: list[int]) -> list[str]:
    rows = [
        "| streams | h2o-server tok/s | mlx_lm.server tok/s | ratio | TTFT p50 ours / theirs (s) "
        "| TTFT p95 ours / theirs (s) | CPU s ours / theirs |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in streams:
        keys = ("tok_s", "ttft_p50", "ttft_p95", "cpu_s")
        a, b = ({k: _median(records, k, streams=n, server=s) for k in keys} for s in (OURS, MLX_LM))
        ratio = _ratios(records, "tok_s", streams=n)
        rows.append(
            f"| {n} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {ratio:.2f}x "
            f"| {a['ttft_p50']:.2f} / {b['ttft_p50']:.2f} "
            f"| {a['ttft_p95']:.2f} / {b['ttft_p95']:.2f} | {a['cpu_s']:.0f} / {b['cpu_s']:.0f} |"
        )
    return rows


def long_table(records: list[dict]) -> list[str]:
    rows = ["| | h2o-server (h2o, max_kv 512) | mlx_lm.server | ratio |", "|---|---|---|---|"]
    figures = [
        ("aggregate tok/s", "tok_s", "{:.1f}"),
        ("TTFT p50 (s)", "ttft_p50", "{:.2f}"),
        ("TTFT p95 (s)", "ttft_p95", "{:.2f}"),
        ("peak RSS (MiB)", "peak_rss", "{:.0f}"),
        ("KV cache (MiB)", "kv_bytes", "{:.1f}"),
        ("server CPU s", "cpu_s", "{:.0f}"),
        ("longest history (tokens)", "history_tokens", "{:.0f}"),
        ("document turn, wall s", "document_seconds", "{:.1f}"),
    ]
    for label, key, fmt in figures:
        scale = 2**20 if key in ("peak_rss", "kv_bytes") else 1
        a, b = (_median(records, key, server=s) / scale for s in (OURS, MLX_LM))
        rows.append(
            f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {_ratios(records, key):.2f}x |"
        )
    return rows


def plot(records: list[dict], streams: list[int], path: Path) -> Path:
    from bench.plots import _save, plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for k, name in enumerate((OURS, MLX_LM)):
        xs = [i + (k - 0.5) * width for i in range(len(streams))]
        ax1.bar(xs, [_median(records, "tok_s", streams=n, server=name) for n in streams],
                width, label=name)  # fmt: skip
        ax2.bar(xs, [_median(records, "ttft_p50", streams=n, server=name) for n in streams],
                width, label=name)  # fmt: skip
    for ax, title, ylabel in ((ax1, "aggregate throughput", "tok/s"),
                              (ax2, "time to first token, p50", "seconds")):  # fmt: skip
        ax.set_xticks(range(len(streams)), [str(n) for n in streams])
        ax.set_xlabel("concurrent streaming chats")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--turns", type=int, default=2, help="turns per chat in part 1")
    p.add_argument("--turn-tokens", type=int, default=120, help="tokens of each user turn")
    p.add_argument("--max-tokens", type=int, default=64, help="reply tokens per turn")
    p.add_argument("--long-streams", type=int, default=8)
    p.add_argument("--long-document", type=int, default=3600, help="tokens of the pasted document")
    p.add_argument("--long-turns", type=int, default=3, help="turns after the document")
    p.add_argument("--long-max-kv", type=int, default=512)
    p.add_argument("--skip-long", action="store_true")
    p.add_argument(
        "--policy",
        help="part 1: this server's chats in this cache policy (`kv_cache` extension; "
        "default: the server's own, auto)",
    )
    p.add_argument("--max-kv", type=int, default=256, help="part 1's max_kv with --policy")
    p.add_argument("--out", type=Path, default=None, help="markdown report (a PNG beside it)")
    args = p.parse_args(argv)
    began = time.perf_counter()
    folder = export_default()

    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(folder)  # the clients' own copy, for the essay passages
    load = load_runs(folder, tokenizer, args)
    long = [] if args.skip_long else long_chat_runs(folder, tokenizer, args)
    png = plot(load, args.streams, (args.out or Path("docs/server_load.md")).with_suffix(".png"))
    single = _median(load, "tok_s", streams=1, server=OURS)
    own_scaling = [
        f"- h2o-server at {n} streams vs its own single stream: "
        f"{_median(load, 'tok_s', streams=n, server=OURS) / single:.2f}x"
        for n in args.streams if n > 1
    ]  # fmt: skip
    body = [
        f"Machine: {machine()}; OpenBLAS {openblas()} in both servers. "
        f"{time.perf_counter() - began:.0f} s in all.",
        "",
        "## Concurrent chats",
        "",
        f"Each client holds a {args.turns}-turn chat (user turns of {args.turn_tokens} essay "
        f"tokens, {args.max_tokens}-token greedy replies). Medians over {args.rounds} rounds; the "
        "ratio is h2o-server / mlx_lm.server within each round, then the median. "
        + (
            f"h2o-server holds every chat in policy `{args.policy}`, max_kv {args.max_kv} "
            "(`kv_cache` extension); mlx_lm.server keeps full caches."
            if args.policy
            else "h2o-server's chats are in its default policy (`auto`); mlx_lm.server keeps "
            "full caches."
        ),
        "",
        *load_table(load, args.streams),
        "",
        *own_scaling,
        "",
        f"![throughput and TTFT]({png.name})",
    ]
    if long:
        body += [
            "",
            f"## {args.long_streams} long chats (the case this server is for)",
            "",
            f"Each chat pastes a {args.long_document}-token document (its turn is timed apart: "
            f"'document turn'), then {args.long_turns} more turns of {args.turn_tokens} tokens "
            f"with {args.max_tokens}-token replies; figures are over those turns. h2o-server "
            f"holds each chat in an H2O cache of max_kv {args.long_max_kv} (`kv_cache` "
            "extension); mlx_lm.server keeps full caches. KV cache: ours as /metrics reports "
            "it; mlx_lm.server's computed from the tokens its caches must hold (float32), a "
            "lower bound.",
            "",
            *long_table(long),
        ]
    publish(
        "Serving load: h2o-server vs mlx_lm.server",
        __doc__.split("\n\n")[1].strip(),
        command("bench.server_load", argv),
        body,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
