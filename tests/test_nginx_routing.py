"""deploy/nginx.conf routing, run by the real nginx against small stand-in replicas.

No model: each stand-in answers with its own name, so the tests see where nginx
sent a request. tests/test_replicas.py runs the same file in front of real servers.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from nginx_harness import MISSING, NGINX, Nginx

pytestmark = pytest.mark.skipif(NGINX is None, reason=MISSING)


class StandIn(ThreadingHTTPServer):
    """A replica stand-in: names itself; can answer 503 (draining) or stream slowly."""

    daemon_threads = True

    def __init__(self, name: str):
        super().__init__(("127.0.0.1", 0), Handler)
        self.name, self.draining, self.seen = name, False, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server_address[1]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._reply(200, {"replica": self.server.name})

    def do_DELETE(self) -> None:
        self._reply(200, {"replica": self.server.name})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen += 1
        if self.server.draining:
            return self._reply(503, {"error": {"message": "the server is shutting down"}})
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"data: {i} {time.monotonic()}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.4)
            self.wfile.write(b"0\r\n\r\n")
            return None
        return self._reply(200, {"replica": self.server.name})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def cluster(tmp_path):
    replicas = [StandIn("a"), StandIn("b")]
    nginx = Nginx([r.port for r in replicas], tmp_path / "nginx")
    yield nginx, replicas
    nginx.stop()
    for r in replicas:
        r.shutdown()
        r.server_close()


def send(nginx, method="POST", path="/v1/chat/completions", body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", nginx.port, timeout=30)
    data = json.dumps(body or {"messages": []}) if method == "POST" else None
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, (json.loads(payload)["replica"] if r.status == 200 else None)


def test_a_conversation_sticks_to_one_replica_whichever_way_it_is_named(cluster):
    nginx, _ = cluster
    homes = {}
    for i in range(40):
        key = f"conv-{i}"
        by_header = {send(nginx, headers={"X-Session-ID": key})[1] for _ in range(3)}
        by_body = send(nginx, body={"messages": [], "prompt_cache_key": key})[1]
        by_path = send(nginx, "DELETE", f"/v1/sessions/{key}")[1]
        assert len(by_header) == 1 and by_body in by_header and by_path in by_header, key
        homes[key] = by_body
    assert set(Counter(homes.values())) == {"a", "b"}  # the keys spread over both
    # The body's key wins over the header, as in the server.
    both = {"messages": [], "prompt_cache_key": "conv-0"}
    other = next(k for k, home in homes.items() if home != homes["conv-0"])
    assert send(nginx, body=both, headers={"X-Session-ID": other})[1] == homes["conv-0"]


def test_requests_without_a_key_are_spread(cluster):
    nginx, _ = cluster
    assert set(send(nginx)[1] for _ in range(10)) == {"a", "b"}
    assert set(send(nginx, "GET", "/health")[1] for _ in range(10)) == {"a", "b"}


def test_a_draining_or_dead_replica_is_skipped_without_an_error(cluster):
    nginx, (a, b) = cluster
    keys = [f"conv-{i}" for i in range(20)]
    homes = {k: send(nginx, headers={"X-Session-ID": k})[1] for k in keys}
    a.draining = True  # answers 503, as a server does after SIGTERM
    replies = [send(nginx, headers={"X-Session-ID": k}) for k in keys]
    assert replies == [(200, "b")] * len(keys)
    a.shutdown()
    a.server_close()  # gone: connections refused
    replies = [send(nginx, headers={"X-Session-ID": k}) for k in keys]
    assert replies == [(200, "b")] * len(keys)
    assert "a" in homes.values()


def test_streams_are_not_buffered(cluster):
    nginx, _ = cluster
    conn = http.client.HTTPConnection("127.0.0.1", nginx.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({"stream": True}))
    r = conn.getresponse()
    first = r.readline()
    arrived = time.monotonic()
    sent = float(first.split()[2])
    rest = r.read()
    conn.close()
    assert arrived - sent < 0.3, "the first event waited for the rest of the stream"
    assert rest.count(b"data:") == 2
