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
        """Plain HTTP, for what the SDK would refuse to send (bad JSON, bad bytes)."""
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        conn = self.connection()
        try:
            conn.request(
                method,
                path,
                body=body,
                headers={"Content-Type": "application/json", **self.auth, **(headers or {})},
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


@contextlib.contextmanager
def running_server(tmp: Path, *flags: str, timeout: float = 120) -> Iterator[Server]:
    log = tmp / f"server-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        try:
            process, port = start_server(list(flags), stdout=out, timeout=timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{log.read_text()}") from None
    api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
    try:
        yield Server(port, process, log, api_key)
    finally:
        stop_server(process)
