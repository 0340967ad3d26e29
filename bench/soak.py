"""Soak: many clients with random disconnects, bad inputs and restarts on one spill folder.

Starts `h2o-server serve` on a loopback port with a small memory budget and a
spill folder, then sends `--requests` requests from `--clients` threads: turns
of keyed and anonymous conversations (streamed or not), clients that hang up
midway, bad inputs, deletions. Between phases the server is restarted on the
same port and folder, by SIGTERM (drain and spill) or SIGKILL (crash). At the
end it checks for leaks (sessions without a cache or a file, files without a
session, anything left after deleting every session) and compares the server's
RSS at the end with its RSS after warm-up.

    python -m bench.soak --requests 200 --clients 16 --out docs/soak.md
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import select
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.local_server import free_port, start_server
from bench.report import command, machine, publish
from config.blas import preload_openblas
from server.sessions.claims import ALIVE

BOOKKEEPING = {".lock", ALIVE}

MODEL = "default"
CONTEXT = 8192
TOPICS = ("rivers", "owls", "trains", "bread", "glaciers", "chess", "tea", "comets")
KINDS = {"turn": 33, "stream": 20, "anonymous": 8, "drop": 14, "bad": 20, "delete": 5}
BAD = {
    "malformed json": b'{"model": "default", "messages": [',
    "seed 2**64": {"seed": 2**64},
    "prompt over the context": {
        "messages": [{"role": "user", "content": "word " * (CONTEXT + 50)}]
    },
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    "json mode": {"response_format": {"type": "json_object"}},
    "n = 2": {"n": 2},
    "unknown model": {"model": "gpt-9"},
    "bad session id": {"prompt_cache_key": "../../etc/passwd"},
    "negative max_tokens": {"max_tokens": -1},
    "kv_cache too big": {"kv_cache": {"max_kv": 10**9}},
}


@dataclass
class Conversation:
    key: str | None  # None: anonymous, found by prefix
    history: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    turns: int = 0
    restored_after_restart: bool = False  # its first turn after a restart reused a cache


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: the client hung up before an answer
    code: str | None = None
    cached: int | None = None
    text: str = ""
    stream_error: str | None = None


class Soak:
    def __init__(self, args, spill: Path, log: Path):
        self.args, self.spill, self.log = args, spill, log
        self.port = free_port()
        self.flags = [
            "--spill-dir", str(spill), "--max-sessions", str(args.max_sessions),
            "--kv-budget", args.kv_budget, "--policy", "h2o", "--shutdown-timeout", "2",
        ]  # fmt: skip
        self.process = None
        self.rng = random.Random(args.seed)
        self.rng_lock = threading.Lock()
        self.conversations = [Conversation(f"soak-{i}") for i in range(24)]
        self.conversations += [Conversation(None) for _ in range(6)]
        self.outcomes: list[Outcome] = []
        self.done = 0
        self.count_lock = threading.Lock()
        self.rss: list[tuple[int, int]] = []  # (requests done, kB)
        self.restarts: list[dict] = []
        self.cancelled = 0  # h2o_requests_cancelled_total, summed over server lifetimes
        self.after_restart = False

    # ------------------------------------------------------------------ server

    def start(self) -> float:
        t0 = time.monotonic()
        with open(self.log, "a") as out:
            self.process, _ = start_server(self.flags, stdout=out, port=self.port)
        return time.monotonic() - t0

    def restart(self, how: str, at: int) -> None:
        self.cancelled += self.metrics()["h2o_requests_cancelled_total"]
        sig = signal.SIGTERM if how == "term" else signal.SIGKILL
        t0 = time.monotonic()
        self.process.send_signal(sig)
        self.process.wait(timeout=60)
        stopped = time.monotonic() - t0
        ready = self.start()
        indexed = len(self.get("/v1/sessions")["data"])
        self.restarts.append(dict(at=at, how=how, stopped=stopped, ready=ready, indexed=indexed))
        for c in self.conversations:
            c.restored_after_restart = False
        self.after_restart = True

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    # ------------------------------------------------------------------ HTTP

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def get(self, path: str) -> dict:
        conn = self.connection()
        conn.request("GET", path)
        body = conn.getresponse().read()
        conn.close()
        return json.loads(body)

    def metrics(self) -> dict[str, float]:
        conn = self.connection()
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln[:1] != "#")}

    def send(self, kind, method, path, body, drop_after: float | None = None) -> Outcome:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = self.connection()
        conn.request(method, path, data, {"Content-Type": "application/json"})
        if drop_after is not None and not _answered_within(conn.sock, drop_after):
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            return Outcome(kind, None)
        response = conn.getresponse()
        if isinstance(body, dict) and body.get("stream") and response.status == 200:
            return self._read_stream(kind, conn, response, drop_after)
        raw = response.read()
        conn.close()
        out = Outcome(kind, response.status)
        reply = json.loads(raw) if raw else {}
        if response.status >= 400:
            out.code = reply.get("error", {}).get("code") or reply.get("error", {}).get("type")
        elif "choices" in reply:
            out.text = reply["choices"][0]["message"]["content"]
            out.cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        return out

    def _read_stream(self, kind, conn, response, drop_after) -> Outcome:
        out, start = Outcome(kind, 200), time.monotonic()
        for raw in response:
            if drop_after is not None and time.monotonic() - start > drop_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                return Outcome(kind, None)
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out.stream_error = event["error"].get("code") or event["error"]["message"]
            elif event.get("usage"):
                out.cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
            elif event.get("choices"):
                out.text += event["choices"][0]["delta"].get("content") or ""
        conn.close()
        return out

    # ------------------------------------------------------------------ requests

    def one(self, index: int) -> None:
        with self.rng_lock:
            kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            rng = random.Random(self.rng.random())
        outcome = getattr(self, f"_{kind}")(rng)
        with self.count_lock:
            self.outcomes.append(outcome)
            self.done += 1
            if self.done % 10 == 0:
                self.rss.append((self.done, self.rss_kb()))

    def _conversation(self, rng, anonymous: bool) -> Conversation:
        pool = [c for c in self.conversations if (c.key is None) == anonymous]
        while True:
            c = rng.choice(pool)
            if c.lock.acquire(blocking=False):
                return c
            time.sleep(0.01)

    def _turn(self, rng, stream: bool = False, anonymous: bool = False) -> Outcome:
        c = self._conversation(rng, anonymous)
        try:
            messages = c.history + [
                {"role": "user", "content": f"Tell me one fact about {rng.choice(TOPICS)}."}
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": rng.randint(4, 24)}
            body |= {"temperature": rng.choice([0, 0.8]), "seed": rng.randint(-5, 2**40)}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            if c.key:
                body["prompt_cache_key"] = c.key
            out = self.send("stream" if stream else "turn", "POST", "/v1/chat/completions", body)
            if out.status == 200 and not out.stream_error:
                if c.turns and self.after_restart and not c.restored_after_restart:
                    c.restored_after_restart = (out.cached or 0) > 0
                c.history = messages + [{"role": "assistant", "content": out.text}]
                c.turns += 1
                if len(c.history) > 12:  # keep prompts short: start the chat over
                    c.history, c.turns = [], 0
            return out
        finally:
            c.lock.release()

    def _stream(self, rng) -> Outcome:
        return self._turn(rng, stream=True)

    def _anonymous(self, rng) -> Outcome:
        return self._turn(rng, anonymous=True)

    def _drop(self, rng) -> Outcome:
        messages = [{"role": "user", "content": "Write a long essay about the sea."}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 300}
        body["stream"] = rng.random() < 0.5
        return self.send("drop", "POST", "/v1/chat/completions", body, rng.uniform(0.05, 1.5))

    def _bad(self, rng) -> Outcome:
        name = rng.choice(list(BAD))
        bad = BAD[name]
        if isinstance(bad, dict):
            messages = [{"role": "user", "content": "Hi"}]
            bad = {"model": MODEL, "messages": messages, "max_tokens": 4, **bad}
        return self.send("bad", "POST", "/v1/chat/completions", bad)

    def _delete(self, rng) -> Outcome:
        c = self._conversation(rng, anonymous=False)
        try:
            out = self.send("delete", "DELETE", f"/v1/sessions/{c.key}", b"")
            c.history, c.turns = [], 0
            return out
        finally:
            c.lock.release()

    # ------------------------------------------------------------------ checks

    def wait_idle(self) -> None:
        while True:
            m = self.metrics()
            if m["h2o_active_generations"] == 0 and m["h2o_queue_depth"] == 0:
                return
            time.sleep(0.2)

    def leaks(self) -> dict:
        """Sessions and files that do not match, before and after deleting every session."""
        sessions = self.get("/v1/sessions")["data"]
        files = {p.name for p in self.spill.glob("*.safetensors")}
        spilled = {f"{s['id']}.safetensors" for s in sessions if s["spilled"]}
        resident = [s for s in sessions if not s["spilled"]]
        found = {
            "sessions": len(sessions),
            "resident": len(resident),
            "files": len(files),
            "files without a session": len(files - spilled),
            "spilled sessions without a file": len(spilled - files),
            "empty sessions": sum(1 for s in sessions if s["logical_tokens"] == 0),
        }
        for s in sessions:
            conn = self.connection()
            conn.request("DELETE", f"/v1/sessions/{s['id']}")
            conn.getresponse().read()
            conn.close()
        # The running server's own bookkeeping (lock files) is not a leak.
        left = [p for p in self.spill.rglob("*") if p.is_file() and p.name not in BOOKKEEPING]
        found["sessions left after deleting all"] = len(self.get("/v1/sessions")["data"])
        found["files left after deleting all"] = len(left)
        return found


def _answered_within(sock: socket.socket, seconds: float) -> bool:
    readable, _, _ = select.select([sock], [], [], seconds)
    return bool(readable)


def run(args) -> tuple[list[str], bool]:
    tmp = Path(tempfile.mkdtemp(prefix="h2o-soak-"))
    soak = Soak(args, tmp / "spill", tmp / "server.log")
    restarts = dict(r.split(":") for r in args.restarts.split(",") if r)
    edges = sorted({0, *(int(at) for at in restarts), args.requests})
    t0 = time.monotonic()
    soak.start()
    warm_rss = None
    try:
        with ThreadPoolExecutor(args.clients) as pool:
            for start, end in zip(edges, edges[1:], strict=False):
                if str(start) in restarts:
                    soak.wait_idle()
                    soak.restart(restarts[str(start)], start)
                last = end == args.requests
                split = min(end, start + args.warmup) if last else end
                list(pool.map(soak.one, range(start, split)))
                if last:
                    soak.wait_idle()
                    warm_rss = soak.rss_kb()
                    list(pool.map(soak.one, range(split, end)))
        soak.wait_idle()
        end_rss = soak.rss_kb()
        soak.cancelled += soak.metrics()["h2o_requests_cancelled_total"]
        leaks = soak.leaks()
    finally:
        soak.process.terminate()
        soak.process.wait(timeout=60)
    wall = time.monotonic() - t0
    return report(args, soak, leaks, warm_rss, end_rss, wall)


def report(args, soak: Soak, leaks: dict, warm_rss: int, end_rss: int, wall: float):
    statuses = Counter(o.status for o in soak.outcomes)
    by_kind = Counter((o.kind, o.status, o.code) for o in soak.outcomes)
    server_errors = sum(n for s, n in statuses.items() if s is not None and s >= 500)
    stream_errors = [o for o in soak.outcomes if o.stream_error]
    growth = end_rss / warm_rss - 1
    leaked = sum(v for k, v in leaks.items() if k not in ("sessions", "resident", "files"))
    leaked += leaks["resident"] > args.max_sessions
    ok = server_errors == 0 and not stream_errors and leaked == 0 and growth <= 0.10
    restored = sum(c.restored_after_restart for c in soak.conversations)
    body = [
        f"**{'PASS' if ok else 'FAIL'}**: {server_errors} x 5xx, {len(stream_errors)} streams "
        f"ending in an error, {leaked} leaked sessions or files, RSS at the end "
        f"{growth:+.1%} vs after warm-up. {len(soak.outcomes)} requests in {wall:.0f} s.",
        "",
        "| kind | status | code | count |",
        "|---|---|---|---|",
        *(
            f"| {k} | {s if s is not None else 'client hung up'} | {c or ''} | {n} |"
            for (k, s, c), n in sorted(by_kind.items(), key=lambda t: (t[0][0], str(t[0][1])))
        ),
        "",
        f"Requests the server counted as cancelled: {soak.cancelled:.0f} "
        f"(clients that hung up: {statuses[None]}; a few answers beat the hang-up).",
        "",
        "| restart at request | signal | stopped in (s) | ready in (s) | sessions indexed |",
        "|---|---|---|---|---|",
        *(
            f"| {r['at']} | {'SIGTERM' if r['how'] == 'term' else 'SIGKILL'} | "
            f"{r['stopped']:.1f} | {r['ready']:.1f} | {r['indexed']} |"
            for r in soak.restarts
        ),
        "",
        f"Conversations whose first turn after the last restart reused a restored cache: "
        f"{restored}.",
        "",
        "| leak check | count |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in leaks.items()),
        "",
        f"RSS after warm-up ({args.warmup} requests into the last phase): {warm_rss / 1024:.0f} "
        f"MiB; at the end: {end_rss / 1024:.0f} MiB ({growth:+.1%}).",
        "",
        "RSS every 10 requests (MiB): " + ", ".join(f"{n}: {kb / 1024:.0f}" for n, kb in soak.rss),
    ]
    return body, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--restarts", default="40:term,80:kill", help="request:term|kill, ...")
    p.add_argument("--warmup", type=int, default=30, help="requests of the last phase first")
    p.add_argument("--max-sessions", type=int, default=4)
    p.add_argument("--kv-budget", default="64MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    preload_openblas()  # bench.report.machine imports MLX
    body, ok = run(args)
    intro = (
        f"Default model, policy h2o, `--kv-budget {args.kv_budget} --max-sessions "
        f"{args.max_sessions}`, a spill folder, {args.clients} client threads sending "
        f"{args.requests} requests (kinds by weight: {KINDS}), restarts {args.restarts} on the "
        f"same port and folder. Machine: {machine()}."
    )
    publish("Soak: disconnects, bad inputs and restarts", intro,
            command("bench.soak", argv), body, args.out)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
