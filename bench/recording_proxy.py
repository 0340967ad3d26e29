"""A recording reverse proxy on a free loopback port, for running agent CLIs (Codex,
Claude Code) against a server: every request passes through unchanged and its reply is
streamed on unbuffered, and each request's status, size, time to first token, duration
and the usage its stream reports are noted. bench/codex_cli.py and bench/claude_cli.py
say, through an `SseNotes`, which events are a first token and where the usage is.

    with RecordingProxy("http://127.0.0.1:8000", notes) as proxy:
        ... point the client at proxy.url ...
    proxy.records
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}
OUTPUT_KEPT = 2000  # characters of a stream's text kept per request


@dataclass
class ProxiedRequest:
    method: str
    path: str
    status: int
    stream: bool = False
    request_bytes: int = 0
    ttft_s: float | None = None  # to the stream's first token; None: none came
    seconds: float | None = None  # until the reply ended; None: it had not (cut off)
    events: int = 0  # SSE data events passed on
    output: str = ""  # the streamed text and call arguments (the first OUTPUT_KEPT)
    input_tokens: int | None = None  # the prompt's tokens, cached ones included
    cached_tokens: int | None = None  # of them, reused from the server's cache


@dataclass(frozen=True)
class SseNotes:
    """What one API's stream events tell: `token(event)` the text of an event that carries
    the reply's tokens (None: it carries none); `usage(event)` (prompt tokens, cached
    tokens) where the event reports them, else None."""

    token: Callable[[dict], str | None]
    usage: Callable[[dict], tuple[int, int] | None]


class RecordingProxy:
    def __init__(self, target: str, notes: SseNotes, timeout: float = 3600):
        self.target = urlsplit(target)
        self.notes = notes
        self.timeout = timeout
        self.records: list[ProxiedRequest] = []
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> RecordingProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def note(self, record: ProxiedRequest, data: bytes, elapsed: float) -> None:
        """One SSE `data:` payload of `record`'s stream."""
        record.events += 1
        try:
            event = json.loads(data)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if (usage := self.notes.usage(event)) is not None:
            record.input_tokens, record.cached_tokens = usage
        if (text := self.notes.token(event)) is not None:
            if record.ttft_s is None:
                record.ttft_s = elapsed
            if len(record.output) < OUTPUT_KEPT:
                record.output += text

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def forward(self) -> None:
                start = time.monotonic()
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                t = proxy.target
                upstream = http.client.HTTPConnection(t.hostname, t.port or 80, proxy.timeout)
                record = ProxiedRequest(self.command, self.path, 502, request_bytes=len(body))
                with proxy.lock:  # listed now: a run cut off mid-request still shows it
                    proxy.records.append(record)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    reply = upstream.getresponse()
                    record.status = reply.status
                    kind = reply.getheader("content-type", "")
                    record.stream = kind.startswith("text/event-stream")
                    self.relay(reply, record, start)
                except OSError:
                    if record.status == 502:  # the server never answered
                        self.send_error(502)
                finally:
                    upstream.close()
                    record.seconds = time.monotonic() - start

            def relay(self, reply, record: ProxiedRequest, start: float) -> None:
                """Send the reply on as it comes, noting each SSE event of a stream."""
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
                pending = b""
                while self.command != "HEAD" and (piece := reply.read1(65536)):
                    if record.stream:
                        *lines, pending = (pending + piece).split(b"\n")
                        for line in lines:
                            if line.startswith(b"data:"):
                                proxy.note(record, line[5:].strip(), time.monotonic() - start)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                    self.wfile.flush()
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = forward

        return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up: no news
            super().handle_error(request, client_address)


def run_cli(
    command: list[str], cwd: str | Path, env: dict[str, str], timeout: float
) -> tuple[int, str, str, float]:
    """Run an agent CLI to its end: (exit status, stdout, stderr, seconds); a run past
    `timeout` is killed, with status 124 and what it had printed."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
        status, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        status, out, err = 124, _text(e.stdout), _text(e.stderr) + f"\n(timed out: {timeout} s)"
    return status, out, err, time.monotonic() - start


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
