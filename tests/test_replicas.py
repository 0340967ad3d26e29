"""Two real replicas behind the real nginx (deploy/nginx.conf) on loopback, one shared spill folder.

4 conversations x 4 turns through nginx, one at a time (batch size 1, so greedy
replies compare exactly with an uninterrupted run on one server). After turn 2 the
replica holding the most conversations is stopped: with SIGTERM it drains and
spills them, and the other restores them; with SIGKILL they are rebuilt from the
history, or, with --spill-idle-seconds, restored from what was spilled while idle.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections import Counter

import pytest
from nginx_harness import MISSING, NGINX, Nginx
from server_harness import MODEL, launch

pytestmark = [pytest.mark.skipif(NGINX is None, reason=MISSING), pytest.mark.slow(seconds=210)]

CONVERSATIONS, TURNS, KILL_AFTER = 4, 4, 2
TOPICS = ["rivers", "bread", "owls", "glass", "comets", "tea", "maps", "bees", "salt", "bells"]
FLAGS = ["--model", "default", "--policy", "h2o", "--max-sessions", "20", "--shutdown-timeout", "5"]


def question(conv: int, turn: int) -> str:
    topic = TOPICS[conv % len(TOPICS)]
    return [
        f"Conversation {conv}. Tell me one fact about {topic}.",
        "Say it again in other words.",
        "Why does that matter?",
        "Summarize in five words.",
    ][turn]


def ask(port: int, conv: int, key: str, messages: list[dict]) -> dict:
    """One turn through nginx: conversations with an even number name themselves in the body,
    odd ones in the X-Session-ID header."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    sent = {"Content-Type": "application/json"}
    if conv % 2:
        sent["X-Session-ID"] = key
    else:
        body["prompt_cache_key"] = key
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), sent)
        r = conn.getresponse()
        data = json.loads(r.read())
    finally:
        conn.close()
    out = {"status": r.status, "replica": r.getheader("X-H2O-Replica", "")}
    if r.status == 200:
        out["reply"] = data["choices"][0]["message"]["content"]
        out["cached"] = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        out["session"] = r.getheader("X-Session-ID")
    else:
        out["error"] = data
    return out


def run_turns(
    port: int, histories: list[list[dict]], turns: range, keys: list[str]
) -> list[list[dict]]:
    """Turns `turns` of every conversation, in order; histories grow with each reply."""
    results = [[] for _ in histories]
    for turn in turns:
        for conv, history in enumerate(histories):
            history.append({"role": "user", "content": question(conv, turn)})
            out = ask(port, conv, keys[conv], history)
            results[conv].append(out)
            history.append({"role": "assistant", "content": out.get("reply", "")})
    return results


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Every reply of an uninterrupted run on one server (no nginx: the port is the server's)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    server = launch(tmp, *FLAGS, "--spill-dir", str(tmp / "spill"))
    try:
        histories = [[] for _ in range(CONVERSATIONS)]
        keys = [f"conv-{conv}" for conv in range(CONVERSATIONS)]
        results = run_turns(server.port, histories, range(TURNS), keys)
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)
    assert all(r["status"] == 200 for conv in results for r in conv)
    return [[r["reply"] for r in conv] for conv in results]


def keys_on_both(port: int, replicas: int) -> list[str]:
    """Conversation keys that nginx spreads over every replica. Ketama places keys by the
    replicas' addresses, which are random ports here, so a fixed set of keys can all land
    on one; asking where each key goes (nginx names the replica on any reply, a 404 too)
    keeps the test about failover, not about luck."""
    for salt in range(100):
        keys = [f"conv-{conv}-{salt}" for conv in range(CONVERSATIONS)]
        homes = set()
        for key in keys:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request("GET", f"/v1/sessions/{key}")
                r = conn.getresponse()
                r.read()
                homes.add(r.getheader("X-H2O-Replica", ""))
            finally:
                conn.close()
        if len(homes) == replicas:
            return keys
    raise AssertionError(f"no {CONVERSATIONS} keys in 100 tries spread over both replicas")


def counter(server, name: str) -> float:
    return server.metrics().get(f"h2o_{name}", 0.0)


@pytest.mark.parametrize(
    ("stop", "idle"),
    [(signal.SIGTERM, None), (signal.SIGKILL, None), (signal.SIGKILL, "1")],
    ids=["sigterm", "sigkill-rebuilt", "sigkill-idle-spilled"],
)
def test_conversations_stick_and_survive_a_replica_stopping(tmp_path, uninterrupted, stop, idle):
    flags = [*FLAGS, "--spill-dir", str(tmp_path / "shared")]
    flags += ["--spill-idle-seconds", idle] if idle else []
    replicas = [launch(tmp_path, *flags), launch(tmp_path, *flags)]
    by_addr = {f"127.0.0.1:{r.port}": r for r in replicas}
    nginx = Nginx([r.port for r in replicas], tmp_path / "nginx")
    try:
        histories = [[] for _ in range(CONVERSATIONS)]
        keys = keys_on_both(nginx.port, len(replicas))
        before = run_turns(nginx.port, histories, range(KILL_AFTER), keys)
        homes = [{r["replica"] for r in conv} for conv in before]
        assert all(len(h) == 1 for h in homes), homes  # each conversation on one replica
        load = Counter(next(iter(h)) for h in homes)
        assert set(load) == set(by_addr), load  # both replicas serve some
        assert all(conv[1]["cached"] > 0 for conv in before)

        victim_addr = load.most_common(1)[0][0]
        victim = by_addr[victim_addr]
        survivor = next(r for r in replicas if r is not victim)
        moved = [c for c, h in enumerate(homes) if victim_addr in h]
        if idle:
            time.sleep(float(idle) + 1)  # the victim spills its idle sessions
        victim.process.send_signal(stop)  # turns go on at once: during the drain, too
        after = run_turns(nginx.port, histories, range(KILL_AFTER, TURNS), keys)
        victim.process.wait(timeout=60)

        results = [b + a for b, a in zip(before, after, strict=True)]
        statuses = Counter(r["status"] for conv in results for r in conv)
        assert statuses == {200: CONVERSATIONS * TURNS}, statuses  # 0 x 5xx, 0 x 4xx
        survivor_addr = f"127.0.0.1:{survivor.port}"
        assert all(r["replica"].endswith(survivor_addr) for conv in after for r in conv)
        replies = [[r["reply"] for r in conv] for conv in results]
        assert replies == uninterrupted  # greedy: as if nothing had happened
        turn3 = [results[c][KILL_AFTER]["cached"] for c in moved]
        if stop == signal.SIGTERM or idle:
            assert all(n > 0 for n in turn3), turn3  # restored from the shared folder
            assert counter(survivor, "sessions_restored_total") >= len(moved)
        else:
            assert all(n == 0 for n in turn3), turn3  # nothing was spilled: rebuilt
        assert all(conv[-1]["cached"] > 0 for conv in results)  # and cached again after
        if stop == signal.SIGTERM:
            # a clean drain: uvicorn re-raises the SIGTERM it caught once it has shut down
            assert victim.process.returncode in (0, -signal.SIGTERM)
            assert f"drained; {len(moved)} session(s) spilled" in victim.log_text()
    finally:
        nginx.stop()
        for r in replicas:
            if r.process.poll() is None:
                r.process.kill()
                r.process.wait()
