"""Start the real `h2o-server serve` on a free loopback port for black-box tests."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai

from bench.local_server import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "s3cret-ui"  # the keyed_api fixture's server


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status_code, self.headers, self.body = status, headers, body

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self):
        return json.loads(self.body)


class Server:
    def __init__(self, port: int, process: subprocess.Popen, log: Path, api_key: str | None):
        self.port, self.process, self.log = port, process, log
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=api_key or "unused", max_retries=0
        )

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None
    ) -> Response:
        """Plain HTTP, for what the SDK would refuse to send (bad JSON, bad bytes).

        A header given as None is left out (e.g. {"Authorization": None}: no credentials).
        """
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **self.auth, **(headers or {})}
        conn = self.connection()
        try:
            conn.request(
                method,
                path,
                body=body,
                headers={k: v for k, v in sent.items() if v is not None},
            )
            r = conn.getresponse()
            return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> Response:
        return self.request("POST", path, body, headers)

    def metrics(self) -> dict[str, float]:
        text = self.get("/metrics").text
        return {
            name: float(value)
            for name, value in (line.split() for line in text.splitlines() if line[:1] != "#")
        }

    def sessions(self) -> dict[str, dict]:
        return {s["id"]: s for s in self.get("/v1/sessions").json()["data"]}

    def log_text(self) -> str:
        return self.log.read_text()

    def open_request(self, body: dict, headers: dict | None = None):
        """POST /v1/chat/completions and return (connection, response) once headers arrive."""
        conn = self.connection()
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Content-Type": "application/json", **self.auth, **(headers or {})},
        )
        return conn, conn.getresponse()

    def wait_for(self, condition, timeout: float = 60, what: str = "condition") -> dict:
        """Poll /metrics until condition(metrics) holds; return those metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {m}"
            time.sleep(0.02)


def largest_layer(session: dict) -> int:
    """The most tokens one layer of a /v1/sessions entry may hold: max_kv, or the largest
    layer's when a layer profile splits it."""
    return max(session["layer_max_kv"] or [session["max_kv"]])


def sse_events(response) -> Iterator[dict | str]:
    """The data of each server-sent event: parsed JSON, or "[DONE]"."""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            yield data if data == "[DONE]" else json.loads(data)


def launch(tmp: Path, *flags: str, timeout: float = 120) -> Server:
    """Start a server the caller stops (or kills) itself."""
    log = tmp / f"server-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        try:
            process, port = start_server(list(flags), stdout=out, timeout=timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{log.read_text()}") from None
    keys = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
    api_key = keys.split(",")[0] if keys else None  # the first of k1,k2
    return Server(port, process, log, api_key)


@contextlib.contextmanager
def running_server(tmp: Path, *flags: str, timeout: float = 120) -> Iterator[Server]:
    server = launch(tmp, *flags, timeout=timeout)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            stop_server(server.process)
