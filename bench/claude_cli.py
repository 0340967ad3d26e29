"""One `claude -p` turn (Claude Code, unmodified) against a server's /v1/messages.

Claude Code runs in a scratch HOME with the environment that keeps it to the server it
is pointed at (no telemetry, no attribution block, few retries) and talks to the server
through a small logging proxy in this process, which records each request's status,
time to its first token (the first `content_block_delta` of a stream) and duration.

    from bench.claude_cli import claude_turn
    turn = claude_turn("http://127.0.0.1:8000", "say hi", model="local-model")
    turn.exit_status, turn.stdout, [(r.path, r.status, r.ttft_s) for r in turn.requests]

    python -m bench.claude_cli http://127.0.0.1:8000 --prompt "say hi" --model local-model

Serve the default model so that Claude Code's ~20k-token first prompt fits: an evicting
policy and the names it sends, e.g. `h2o-server serve --policy h2o --max-prompt-tokens
32768 --served-model-name local-model` (docs/api_messages.md, "Claude Code").
Claude Code is an npm package (`@anthropic-ai/claude-code`); `claude` is found on PATH,
under $CLAUDE_NPM, or given as `claude=`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

# Keeps Claude Code to the server: no telemetry or title requests, no per-prompt
# attribution block (it changes the system prompt's first tokens with every prompt, so
# no two conversations would share a prefix), and a short retry backoff.
QUIET_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "CLAUDE_CODE_MAX_RETRIES": "1",
}
# Claude Code aborts a stream after 300 s without an event other than `ping` (its idle
# timer skips pings; the variable can only raise it) and retries it from scratch: a CPU
# prefill of its ~20k-token first prompt can outlast that. API_TIMEOUT_MS bounds its
# non-streaming fallback the same way.
SLOW_PREFILL_ENV = {"CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000", "API_TIMEOUT_MS": "3600000"}
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}
FIRST_TOKEN = b"event: content_block_delta"


@dataclass
class RequestLog:
    method: str
    path: str
    status: int
    stream: bool
    request_bytes: int
    ttft_s: float | None  # to the first content_block_delta (streams only)
    seconds: float


@dataclass
class ClaudeTurn:
    exit_status: int
    stdout: str
    stderr: str
    seconds: float
    requests: list[RequestLog] = field(default_factory=list)

    def all_ok(self) -> bool:
        """Exit status 0 and every request to the API answered 2xx (Claude Code's HEAD /
        reachability probe takes any status)."""
        api = [r for r in self.requests if r.path.startswith("/v1/")]
        return self.exit_status == 0 and bool(api) and all(200 <= r.status < 300 for r in api)


def find_claude() -> str:
    npm = os.environ.get("CLAUDE_NPM", "/tmp/agents/npm")
    for candidate in (shutil.which("claude"), f"{npm}/node_modules/.bin/claude"):
        if candidate and Path(candidate).exists():
            return candidate
    raise FileNotFoundError(
        "claude not found: npm install --prefix DIR @anthropic-ai/claude-code, CLAUDE_NPM=DIR"
    )


def claude_turn(
    base_url: str,
    prompt: str = "say hi",
    model: str = "local-model",
    small_model: str | None = None,
    timeout: float = 3600,
    api_key: str = "local",
    claude: str | None = None,
    extra_env: dict[str, str] | None = None,
    max_output_tokens: int | None = None,
    scratch: str | Path | None = None,
) -> ClaudeTurn:
    """Run `claude -p PROMPT` once against `base_url` (the server's root, no /v1).

    `max_output_tokens`: Claude Code's own cap on a reply (CLAUDE_CODE_MAX_OUTPUT_TOKENS;
    else it asks for 32000, which a small model at temperature 1 may fill); a reply that
    reaches it makes Claude Code exit 1, so keep it well above a turn's. `scratch`: a
    folder kept for HOME and the working directory; two turns in the same one send the
    same system prompt (it names the working directory), so the second finds the first's
    cache. Else a fresh temporary folder."""
    claude = claude or find_claude()
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="claude-cli-"))
        proxy = stack.enter_context(_Proxy(base_url))
        home, work = Path(scratch, "home"), Path(scratch, "work")
        home.mkdir(parents=True, exist_ok=True)
        work.mkdir(exist_ok=True)
        capped = (
            {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens)} if max_output_tokens else {}
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))},
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": proxy.url,
            "ANTHROPIC_AUTH_TOKEN": api_key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": small_model or model,
            **QUIET_ENV,
            **SLOW_PREFILL_ENV,
            **capped,
            **(extra_env or {}),
        }
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [claude, "-p", prompt],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            status, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            status, out, err = 124, _text(e.stdout), _text(e.stderr) + f"\n(timed out: {timeout} s)"
        seconds = time.perf_counter() - start
        time.sleep(0.2)  # the proxy's last log line lands after the reply's last byte
        return ClaudeTurn(status, out, err, seconds, list(proxy.log))


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up: no news
            super().handle_error(request, client_address)


class _Proxy:
    """A logging reverse proxy on a free loopback port, replies streamed unbuffered."""

    def __init__(self, target: str):
        self.target = urlsplit(target)
        self.log: list[RequestLog] = []
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> _Proxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                start = time.perf_counter()
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                t = proxy.target
                upstream = http.client.HTTPConnection(t.hostname, t.port or 80, timeout=3600)
                status, stream, ttft = 502, False, None  # 502: the server never answered
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    reply = upstream.getresponse()
                    status = reply.status
                    stream = reply.getheader("content-type", "").startswith("text/event-stream")
                    ttft = self.relay(reply, start)
                except OSError:
                    if status == 502:
                        self.send_error(502)
                finally:
                    upstream.close()
                    seconds = time.perf_counter() - start
                    log = RequestLog(
                        self.command, self.path, status, stream, len(body), ttft, seconds
                    )
                    proxy.log.append(log)

            def relay(self, reply, start: float) -> float | None:
                """Send the reply on as it comes; the time its first token passed."""
                self.send_response(reply.status)
                length = reply.getheader("content-length")
                for k, v in reply.getheaders():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                chunked = length is None and self.command != "HEAD"
                if chunked:
                    self.send_header("transfer-encoding", "chunked")
                else:
                    self.send_header("content-length", length or "0")
                self.end_headers()
                ttft, tail = None, b""
                while self.command != "HEAD" and (piece := reply.read1(65536)):
                    if ttft is None and FIRST_TOKEN in tail + piece:
                        ttft = time.perf_counter() - start
                    tail = piece[-len(FIRST_TOKEN) :]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                    self.wfile.flush()
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                return ttft

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = forward

        return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_url", help="the server's root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--prompt", default="say hi")
    parser.add_argument("--model", default="local-model")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--scratch", default=None, help="HOME and cwd kept here (see claude_turn)")
    parser.add_argument("--turns", type=int, default=1, help="the same prompt again, in --scratch")
    args = parser.parse_args(argv)
    ok = True
    for _ in range(args.turns):
        turn = claude_turn(
            args.base_url,
            args.prompt,
            args.model,
            timeout=args.timeout,
            max_output_tokens=args.max_output_tokens,
            scratch=args.scratch,
        )
        _print(turn)
        ok = ok and turn.all_ok()
    return 0 if ok else 1


def _print(turn: ClaudeTurn) -> None:
    for r in turn.requests:
        ttft = f"{r.ttft_s:.1f} s" if r.ttft_s is not None else "-"
        size = f"{r.request_bytes} B"
        print(f"{r.method} {r.path} -> {r.status}  {size}  ttft {ttft}  {r.seconds:.1f} s")
    print(json.dumps({k: v for k, v in asdict(turn).items() if k != "requests"}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
